#!/usr/bin/env bash
# Runs one end-to-end test module (tests/e2e/<name>.py) with a Python 3 that has Debian's
# python3-grpcio and python3-protobuf (a pyenv or venv python3 earlier on PATH may lack them).
# A module with a tests/e2e/<name>.requirements.txt (pinned PyPI packages) runs in a virtualenv
# made once per pin set, /tmp/metrale-e2e-<hash of the pins>, over Debian's python3
# (--system-site-packages keeps its grpcio): the first run needs PyPI, later runs no network.
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
req="tests/e2e/${1%.py}.requirements.txt"
if [ -f "$req" ]; then
  venv=/tmp/metrale-e2e-$(sha256sum "$req" | cut -c1-12)
  exec 9>"$venv.lock"
  flock 9  # one maker at a time; the others wait, then find it made
  if [ ! -e "$venv/.complete" ]; then
    rm -rf "$venv"
    echo "run_e2e: installing $req into $venv"
    "$py" -m venv --system-site-packages "$venv"
    if ! "$venv/bin/pip" install --quiet --disable-pip-version-check --no-input --no-deps --only-binary=:all: \
        -r "$req"; then
      echo "run_e2e: pip could not install $req (PyPI unreachable?)" >&2
      rm -rf "$venv"
      exit 1
    fi
    touch "$venv/.complete"
  fi
  flock -u 9
  py=$venv/bin/python
fi
export PYTHONPATH="tests/e2e${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" "tests/e2e/$1"
