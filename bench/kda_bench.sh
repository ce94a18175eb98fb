#!/usr/bin/env bash
# bench/kda_bench.sh BUNDLE_OR_BINARY [WHEEL_DIR]: our KDA kernels (bench/kda_bench.c) and
# flash-linear-attention's Triton KDA kernels (bench/kda_fla_bench.py) on the same shapes in one
# run on the GPU, then one combined table (and JSON).
#   BUNDLE_OR_BINARY: a gpu-bundle directory (DIR/bin/kda_bench, DIR/lib) or the kda_bench binary.
#   WHEEL_DIR: where fla_core-*.whl lies, installed to a temporary dir when `import fla` fails
#              (default .whl). Needs python3 with torch, triton and einops.
# Results go to $OUT/kda_bench (or /tmp/kda_bench): ours.jsonl, fla.jsonl, kda_bench.json, logs.
#   e.g. bazel build //bench:kda_bench && ../shared/tools/gpu-bundle .bundle/kda bazel-bin/bench/kda_bench
#        (on the GPU machine) bash bench/kda_bench.sh .bundle/kda .whl
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: kda_bench.sh BUNDLE_OR_BINARY [WHEEL_DIR]" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
target=$1
wheels=${2:-.whl}
res=${OUT:-/tmp}/kda_bench
mkdir -p "$res"

if [ -d "$target" ]; then
  bin=$target/bin/kda_bench
  export LD_LIBRARY_PATH=$(cd "$target" && pwd)/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
  bin=$target
fi
[ -x "$bin" ] || { echo "kda_bench.sh: no executable $bin" >&2; exit 2; }

if ! python3 -c 'import fla' 2>/dev/null; then
  whl=$(ls "$wheels"/fla_core-*.whl 2>/dev/null | head -1)
  [ -n "$whl" ] || { echo "kda_bench.sh: fla not importable and no fla_core wheel in $wheels" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kda_fla_site "$whl" ||
    { echo "kda_bench.sh: cannot install $whl" >&2; exit 2; }
  export PYTHONPATH=/tmp/kda_fla_site${PYTHONPATH:+:$PYTHONPATH}
fi

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader 2>/dev/null |
  sed 's/^/gpu: /'

echo "== ours: $bin"
"$bin" --json "$res/ours.jsonl" --dump "$res/small" 2>&1 | tee "$res/ours.log"
rc_ours=${PIPESTATUS[0]}

echo "== fla: $(python3 -c 'import fla; print(fla.__file__)' 2>/dev/null)"
# KDA_FLA_TIMEOUT (seconds, default none): stop fla early and still print the table (Triton
# autotuning of chunk_kda on a fresh machine takes a while; rows come cheapest first).
timeout "${KDA_FLA_TIMEOUT:-0}" python3 "$here/kda_fla_bench.py" --json "$res/fla.jsonl" --check "$res/small" \
  2>&1 | tee "$res/fla.log" | grep -v '^{'
rc_fla=${PIPESTATUS[0]}

python3 "$here/kda_fla_bench.py" --merge "$res/ours.jsonl" "$res/fla.jsonl" --json "$res/kda_bench.json" |
  tee "$res/table.md"
echo "exit: ours $rc_ours, fla $rc_fla; results in $res"
[ "$rc_ours" = 0 ] && [ "$rc_fla" = 0 ]
