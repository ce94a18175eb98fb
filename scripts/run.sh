#!/usr/bin/env bash
# The run command (README "Run"): installs the Debian packages, builds metrale offline, and starts
# the service: metrale-serve runs the gRPC router on 127.0.0.1:50051 and one worker per GPU, or
# one CPU worker when there is no GPU, serving --model or, by default, the small trained glm5_next
# in models/glm5-next-demo (tools/train/README.md). When the service is up, the bundled client
# streams one greedy continuation of --text (or of the token ids --prompt) so the text shows; the
# service then keeps serving until Ctrl-C (or SIGTERM), which drains it. --demo stops it after
# the request.
#
#   scripts/run.sh [--demo] [--model DIR] [--listen HOST:PORT] [--text STR | --prompt 1,2,3]
#                  [--max-new N] [-- more metrale-serve options]
set -euo pipefail
cd "$(dirname "$0")/.."

demo=0 listen=127.0.0.1:50051 model=models/glm5-next-demo max_new=48
prompt_args=(--text "The Python tutorial shows how")
serve_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --demo) demo=1; shift ;;
    --model) model=$2; shift 2 ;;
    --listen) listen=$2; shift 2 ;;
    --text) prompt_args=(--text "$2"); shift 2 ;;
    --prompt) prompt_args=(--prompt "$2"); shift 2 ;;
    --max-new) max_new=$2; shift 2 ;;
    --) shift; serve_args+=("$@"); break ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

scripts/install-deps.sh
bazel build //launcher:metrale-serve //router:metrale-router //worker:metrale-worker //tools:mkckpt

bazel-bin/launcher/metrale-serve --listen "$listen" --model "$model" "${serve_args[@]}" &
serve=$!
trap 'kill -TERM $serve 2>/dev/null; wait $serve' INT TERM
client=(/usr/bin/python3 tools/metrale_client.py --addr "$listen")
for _ in $(seq 1 600); do  # the first run also writes the checkpoint
  if "${client[@]}" --health 2>/dev/null | grep -q "^SERVING"; then break; fi
  kill -0 $serve 2>/dev/null || { wait $serve; exit $?; }
  sleep 0.5
done
echo "run.sh: serving $model on $listen; a greedy request through the bundled client:"
"${client[@]}" "${prompt_args[@]}" --max-new "$max_new"
if [ "$demo" = 1 ]; then
  kill -TERM $serve
  wait $serve
  exit $?
fi
echo "run.sh: still serving on $listen (tools/metrale_client.py --addr $listen --text ... or --chat); Ctrl-C drains and stops"
wait $serve
