#!/usr/bin/env bash
# Installs the CUDA 13 toolkit that metrale builds with (nvcc, the CUDA runtime, cuBLAS, NCCL) at
# PREFIX from NVIDIA's wheels on PyPI, in the layout of the build hosts' /usr/local/cuda: bin/,
# include/ (NCCL's headers too), lib/ with lib64 -> lib, nvvm/, and the libfoo.so development
# links the linker wants. The versions are the build hosts' (their PREFIX/dist-info lists them).
# The Dockerfile's build stage runs it; on a host, scripts/install-deps.sh expects the toolkit at
# /usr/local/cuda already.
#
#   scripts/install-cuda.sh PREFIX      e.g. /usr/local/cuda-13.0, then ln -s it /usr/local/cuda
#
# Needs python3 with pip (Debian's python3-pip) and PyPI.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: scripts/install-cuda.sh PREFIX" >&2; exit 2; }
prefix=$1

WHEELS=(
    nvidia-cuda-nvcc==13.0.88      # nvcc, ptxas, fatbinary, nvlink
    nvidia-cuda-crt==13.0.88       # nvcc's crt/ headers
    nvidia-nvvm==13.0.88           # cicc and libdevice
    nvidia-cuda-runtime==13.0.96   # cudart and the runtime headers (cuda_runtime_api.h, cuda_bf16.h, cuda.h)
    nvidia-cuda-cccl==13.0.85      # libcu++, CUB, Thrust (nvcc includes them)
    nvidia-nvtx==13.0.85           # nvtx3/ headers
    nvidia-cuda-profiler-api==13.0.85  # cuda_profiler_api.h (bench/decode_bench --profile)
    nvidia-cublas==13.1.0.3        # cuBLAS and cuBLASLt
    nvidia-nccl-cu13==2.28.9       # NCCL
)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip install --quiet --no-deps --only-binary=:all: --no-compile --disable-pip-version-check \
    --target "$work" "${WHEELS[@]}"

mkdir -p "$prefix"
# nvidia/cu13/{bin,include,lib,nvvm} and nvidia/nccl/{include,lib} merge into PREFIX.
for d in "$work/nvidia/cu13" "$work/nvidia/nccl"; do
    cp -a "$d/." "$prefix/"
done
mkdir -p "$prefix/dist-info"
cp -a "$work"/*.dist-info "$prefix/dist-info/"
rm -f "$prefix/lib/"*/__init__.py "$prefix/"*/__init__.py "$prefix/__init__.py"
[ -e "$prefix/lib64" ] || ln -s lib "$prefix/lib64"
# libfoo.so -> libfoo.so.N, as the toolkit's own installers make them.
for so in "$prefix"/lib/lib*.so.[0-9]*; do
    base=${so%%.so.*}.so
    [ -e "$base" ] || ln -s "$(basename "$so")" "$base"
done
for f in bin/nvcc include/cuda_runtime_api.h include/cublas_v2.h include/nccl.h lib/libcudart.so lib/libcublas.so \
         lib/libcublasLt.so lib/libnccl.so nvvm/bin/cicc; do
    [ -e "$prefix/$f" ] || { echo "install-cuda: $prefix/$f missing after the install" >&2; exit 1; }
done
echo "install-cuda: $("$prefix/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/CUDA \1/p') at $prefix"
