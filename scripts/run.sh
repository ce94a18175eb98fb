#!/usr/bin/env bash
# The run command (README "Run"): installs the Debian packages, builds metrale offline, and runs
# the model on the CPU backend: with no --model, it first writes a small random glm5_next
# checkpoint (tools/configs/cpu-small.json) under .cache/, then prefills the prompt and greedily
# generates, printing the token ids and tokens per second.
#
#   scripts/run.sh [--model DIR] [--prompt 1,2,3] [--max-new N] [--threads N]
set -euo pipefail
cd "$(dirname "$0")/.."

model="" prompt="1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16" max_new=32 threads=0
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --prompt) prompt=$2; shift 2 ;;
    --max-new) max_new=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

scripts/install-deps.sh
bazel build //worker/cli:metrale-generate //tools:mkckpt

if [ -z "$model" ]; then
  model=.cache/cpu-small
  if [ ! -f "$model/config.json" ] || [ tools/configs/cpu-small.json -nt "$model/config.json" ]; then
    rm -rf "$model"
    bazel-bin/tools/mkckpt --config tools/configs/cpu-small.json --out "$model" --seed 1
  fi
fi
exec bazel-bin/worker/cli/metrale-generate --model "$model" --prompt "$prompt" --max-new "$max_new" \
  --threads "$threads"
