#!/usr/bin/env bash
# bench/gpu/serving_goals.sh [STEP...]: the serving figures of docs/PERF.md's openloop sections in
# one device call, from the repository root on the GPU machine, with .gpu/serving.tar.xz
# (bench/gpu/bundle.sh) carried. Each step writes $OUT/STEP.txt and prints its table rows:
#   tests      the packed GPU tests of the bundle (kernels_cuda_dense_test, model_cuda_test; MODEL_TESTS:
#              a gtest filter of the latter's, default all)
#   pack_ab    batch_bench --batches 16,64 and the engine alone on the mix, projections packed and
#              apart (--pack-projections 1 / 0), alternated AB_ROUNDS times (default 2)
#   prefill_ab the GPU tests of the prefill kernels' alternative tiles (CudaAttnMla.*,
#              CudaMoe.ExpertsWgmmaMatchCpu), then decode_bench --op-profile 1 (prefill 512 and 4096
#              against the peak, each op's time) with the default tiles and with --moe-wide-down 1
#              --attend-rows 64, alternated AB_ROUNDS times; then the engine alone on the mix both ways
#   direct     the engine alone on the mix (serving_direct, all requests at t = 0)
#   sat        saturation through the router (64 req/s offered) with this tree's binaries
#   sat_ref    the same with the reference's (bundle o: 2213d32, bench/gpu/reference.sh)
#   rates      6, 12 and 18 req/s (the ITL spread below the goodput)
#   good       goodput by bisection (GOOD_LO .. GOOD_HI, GOOD_STEPS steps)
#   good_prefix  the same on the mix with a common 512-token prefix
# Default steps: direct sat sat_ref rates good. A step starts only while END seconds (default
# 570) minus its need are left since the script began (or, with DEADLINE set, until that epoch
# second: one budget for several invocations in one call). The mix: MODEL (random:bench-4L),
# BACKEND (cuda), REQUESTS (300), PROMPT_MIX (64,256,1024), NEW_MIX (32,128), max 64 sequences.
# WORKER_ARGS: more options for this tree's worker (openloop_bench's --worker-args); SD_ARGS: more
# for serving_direct (e.g. "--pack-projections 1").
set -u
t0=$(date +%s)
deadline=${DEADLINE:-$(( t0 + ${END:-570} ))}
left() { echo $(( deadline - $(date +%s) )); }
out=${OUT:-/tmp/serving_goals}
mkdir -p "$out"
[ -d .gpu/n ] || tar -C .gpu -xJf .gpu/serving.tar.xz
n=.gpu/n wrap=$(pwd)/.gpu/n/wrap
model=${MODEL:-random:bench-4L} backend=${BACKEND:-cuda} requests=${REQUESTS:-300}
mix="--prompt-mix ${PROMPT_MIX:-64,256,1024} --new-mix ${NEW_MIX:-32,128} --max-sequences 64"
ob="python3 bench/openloop_bench.py --model $model --backend $backend $mix --requests $requests --stubs $n/stubs"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > "$out/gpu.txt" 2>&1
step() { # name need cmd...
    local name=$1 need=$2
    shift 2
    if [ "$(left)" -lt "$need" ]; then echo "== $name: skipped, $(left) s left"; return; fi
    "$@" > "$out/$name.txt" 2>&1
    echo "== $name (rc $?, $(left) s left)"
    grep -E '^\||PASSED|FAILED' "$out/$name.txt" | tail -8
    grep -oE '"(tok_per_s|itl_p99_ms|host_wait_s|device_gap_s)": [0-9.]+' "$out/$name.txt" | grep -v '^\{' | tr '\n' ' '
    echo
}
new() { env METRALE_ROUTER_BIN=$wrap/n-router METRALE_WORKER_BIN=$wrap/n-worker "$@"; }
ref() { env METRALE_ROUTER_BIN=$wrap/o-router METRALE_WORKER_BIN=$wrap/o-worker "$@"; }
wa=()
[ -n "${WORKER_ARGS:-}" ] && wa=(--worker-args " $WORKER_ARGS")
for s in ${*:-direct sat sat_ref rates good}; do
    case $s in
    tests)
        step dense 60 env LD_LIBRARY_PATH=$n/lib $n/bin/kernels_cuda_dense_test --gtest_filter='*MatmulMulti*:*MatmulExactClasses*'
        step model 120 env LD_LIBRARY_PATH=$n/lib $n/bin/model_cuda_test --gtest_filter="${MODEL_TESTS:-*}" ;;
    prefill_ab)
        step attn_tests 150 env LD_LIBRARY_PATH=$n/lib $n/bin/kernels_cuda_attn_test --gtest_filter='CudaAttnMla.*'
        step moe_tests 90 env LD_LIBRARY_PATH=$n/lib $n/bin/kernels_cuda_dense_test \
            --gtest_filter='CudaMoe.ExpertsWgmmaMatchCpu'
        for i in $(seq ${AB_ROUNDS:-2}); do
            for t in "0 32" "1 64"; do
                set -- $t
                step db$i.w$1.r$2 100 env LD_LIBRARY_PATH=$n/lib $n/bin/decode_bench --steps 16 --op-profile 1 \
                    --moe-wide-down $1 --attend-rows $2
                [ -f "$out/db$i.w$1.r$2.txt" ] &&
                    grep -E '^\| prefill|moe_experts \((gate|down)|mla_sparse \(attend' "$out/db$i.w$1.r$2.txt"
            done
        done
        for t in "0 32" "1 64"; do
            set -- $t
            step sd.w$1.r$2 45 env LD_LIBRARY_PATH=$n/lib $n/bin/serving_direct --model $model --backend $backend $mix \
                --requests $requests --moe-wide-down $1 --attend-rows $2
        done ;;
    pack_ab)
        for i in $(seq ${AB_ROUNDS:-2}); do
            for p in 1 0; do
                step bb$i.p$p 60 env LD_LIBRARY_PATH=$n/lib $n/bin/batch_bench --batches 16,64 --pack-projections $p
                step sd$i.p$p 45 env LD_LIBRARY_PATH=$n/lib $n/bin/serving_direct --model $model --backend $backend \
                    $mix --requests $requests --pack-projections $p
            done
        done ;;
    direct) step direct 45 env LD_LIBRARY_PATH=$n/lib $n/bin/serving_direct --model $model --backend $backend $mix \
                --requests $requests ${SD_ARGS:-} ;;
    sat) step sat 45 new $ob --rates 64 "${wa[@]}" ;;
    sat_ref) step sat_ref 75 ref $ob --rates 64 ;;
    rates) step rates 150 new $ob --rates 6,12,18 "${wa[@]}" ;;
    good) step good 120 new $ob --goodput --goodput-lo ${GOOD_LO:-24} --goodput-hi ${GOOD_HI:-40} \
              --goodput-steps ${GOOD_STEPS:-1} "${wa[@]}" ;;
    good_prefix) step good_prefix 120 new $ob --shared-prefix 512 --goodput --goodput-lo ${GOOD_LO:-24} \
                     --goodput-hi ${GOOD_HI:-40} --goodput-steps ${GOOD_STEPS:-1} "${wa[@]}" ;;
    *) echo "serving_goals.sh: unknown step $s" >&2 ;;
    esac
done
echo "done, $(left) s left"
