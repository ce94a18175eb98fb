#!/usr/bin/env bash
# bench/gpu/reference.sh [DIR]: builds the serving figures' reference, 2213d32's router and
# worker, in a git worktree at DIR (default /tmp/metrale-2213d32), `-c opt`, with the one change
# that lets them run on a many-core host: the worker's receive loop waits for router messages
# outside its socket lock (2213d32-receive.patch; without it the idle worker's heartbeat thread
# starves and the router writes the worker off 2.5 s after its Hello, docs/PERF.md). Prints the
# two binaries' paths. Run from the repository root.
set -euo pipefail
dir=${1:-/tmp/metrale-2213d32}
patch=$(pwd)/bench/gpu/2213d32-receive.patch
if [ ! -e "$dir/.git" ]; then
    git worktree add --detach "$dir" 2213d32 >/dev/null
    git -C "$dir" apply "$patch"
fi
git -C "$dir" apply --reverse --check "$patch" 2>/dev/null || { echo "reference.sh: $dir lacks the receive fix" >&2; exit 1; }
(cd "$dir" && bazel build -c opt //router:metrale-router //worker:metrale-worker >&2)
echo "$dir/bazel-bin/router/metrale-router"
echo "$dir/bazel-bin/worker/metrale-worker"
