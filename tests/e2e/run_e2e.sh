#!/usr/bin/env bash
# Runs one end-to-end test module (tests/e2e/<name>.py) with a Python 3 that has Debian's
# python3-grpcio and python3-protobuf (a pyenv or venv python3 earlier on PATH may lack them).
# Works under `bazel test` (runfiles root) and from the workspace root after a bazel build.
set -euo pipefail
py=""
for c in /usr/bin/python3 python3; do
  if command -v "$c" >/dev/null && "$c" -c "import grpc, google.protobuf" 2>/dev/null; then py=$c; break; fi
done
if [ -z "$py" ]; then
  echo "run_e2e: no python3 with grpc; install python3-grpcio python3-protobuf (scripts/install-deps.sh)" >&2
  exit 1
fi
export PYTHONPATH="tests/e2e${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" "tests/e2e/$1"
