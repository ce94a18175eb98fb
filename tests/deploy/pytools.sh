#!/usr/bin/env bash
# Runs a Python program (a path from the workspace root) with the PyPI tools pinned in
# tests/deploy/requirements.txt. They live in a virtualenv made once per pin set,
# /tmp/metrale-pytools-<hash of the pins>, by Debian's python3 (python3-venv): the first run
# needs PyPI, later runs no network. Works under bazel test (the runfiles root) and from the
# workspace root.
set -euo pipefail
req=tests/deploy/requirements.txt
[ -f "$req" ] || { echo "pytools: $req not found; run from the workspace root" >&2; exit 1; }
key=$(sha256sum "$req" | cut -c1-12)
venv=/tmp/metrale-pytools-$key

exec 9>"$venv.lock"
flock 9  # one maker at a time; the others wait, then find it made
if [ ! -e "$venv/.complete" ]; then
  rm -rf "$venv"
  echo "pytools: installing the pinned tools into $venv"
  /usr/bin/python3 -m venv "$venv"
  if ! "$venv/bin/pip" install --quiet --disable-pip-version-check --no-input --no-deps --only-binary=:all: \
      -r "$req"; then
    echo "pytools: pip could not install $req (PyPI unreachable?)" >&2
    rm -rf "$venv"
    exit 1
  fi
  touch "$venv/.complete"
fi
flock -u 9
export PATH="$venv/bin:$PATH"
exec "$venv/bin/python" "$@"
