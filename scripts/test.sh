#!/usr/bin/env bash
# The test command (README "Test"; CI runs it through .ci/run): installs the Debian packages,
# then builds everything and runs every test with Bazel, offline. Exit status = the tests' status.
# Extra arguments go to `bazel test` (e.g. scripts/test.sh --test_filter=CudaScale.*).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
exec bazel test //... "$@"
