#!/usr/bin/env bash
# bench/gpu/bundle.sh [REF_DIR]: packs what bench/gpu/serving_goals.sh runs on the GPU machine
# into .gpu/serving.tar.xz (the ignored .gpu/ folder; name it in the device call's carry): this
# tree's router, worker, serving_direct, batch_bench, decode_bench and the GPU tests (bundle n,
# built here first)
# and, with REF_DIR (a tree bench/gpu/reference.sh built), its router and worker (bundle o), each
# with its libraries (../shared/tools/gpu-bundle) and a wrapper in n/wrap; plus the Python gRPC
# stubs made here (the GPU machine has grpcio but no protoc). xz -9: its 64 MiB dictionary folds
# the binaries' common kernels, so the bundle and the tracked tree fit the 64 MiB a call carries.
set -euo pipefail
ref=${1:-}
bazel build //router:metrale-router //worker:metrale-worker //bench:serving_direct //bench:batch_bench \
    //bench:decode_bench //tests:kernels_cuda_dense_test //tests:kernels_cuda_attn_test //tests:model_cuda_test >&2
rm -rf .gpu/n .gpu/o .gpu/serving.tar.xz
mkdir -p .gpu
B=bazel-bin
../shared/tools/gpu-bundle .gpu/n $B/router/metrale-router $B/worker/metrale-worker $B/bench/serving_direct \
    $B/bench/batch_bench $B/bench/decode_bench $B/tests/kernels_cuda_dense_test $B/tests/kernels_cuda_attn_test \
    $B/tests/model_cuda_test >&2
dirs=n
if [ -n "$ref" ]; then
    ../shared/tools/gpu-bundle .gpu/o "$ref/bazel-bin/router/metrale-router" "$ref/bazel-bin/worker/metrale-worker" >&2
    dirs="n o"
fi
mkdir -p .gpu/n/wrap .gpu/n/stubs
for d in $dirs; do
    for b in router worker; do
        printf '#!/bin/sh\nh=$(cd "$(dirname "$0")/../.." && pwd)/%s\nLD_LIBRARY_PATH=$h/lib exec "$h/bin/metrale-%s" "$@"\n' \
            "$d" "$b" > .gpu/n/wrap/$d-$b
        chmod +x .gpu/n/wrap/$d-$b
    done
done
python3 -c "import sys; sys.path.insert(0, 'tools'); import metrale_client as m; m.gen_stubs('.gpu/n/stubs')"
tar -C .gpu -cf - $dirs | xz -9 -T2 > .gpu/serving.tar.xz
ls -l .gpu/serving.tar.xz >&2
