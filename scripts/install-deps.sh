#!/usr/bin/env bash
# Installs the Debian 12 packages that metrale's build, tests and tools need. Idempotent and
# non-interactive: packages already installed are skipped, and apt runs only if one is missing.
# Runs as root directly, otherwise through sudo. The CUDA 13 toolkit is NOT installed here: build
# hosts ship it at /usr/local/cuda (nvcc, cudart, cuBLAS, NCCL); this script only checks for it.
set -euo pipefail

PACKAGES=(
    # build and unit tests
    bazel-bootstrap        # Bazel 4.2.3 (offline; see WORKSPACE)
    build-essential        # gcc/g++ 12, also nvcc's host compiler
    libjson-c-dev          # //third_party:json_c (model config, manifests)
    libpcre2-dev           # //third_party:pcre2 (the tokenizer's regexes)
    libgtest-dev googletest # //third_party:gtest_main
    zlib1g-dev             # //third_party:zlib (the tokenizer test's gzip'd goldens)
    python3 python3-numpy  # tools/ and test fixtures
    python3-venv           # tests/deploy: the pinned PyPI tools (Helm's engine, schemas, hadolint)
    pkg-config
    # serving: router <-> worker messages and the public gRPC API
    libzmq3-dev
    libprotobuf-c-dev protobuf-c-compiler
    libgrpc-dev protobuf-compiler protobuf-compiler-grpc  # protoc + grpc_python_plugin: e2e stubs
    libssl-dev             # //third_party:openssl (the router checks its TLS files)
    openssl                # tests/e2e/tls_test.py makes its certificates with it
    python3-grpcio python3-protobuf   # end-to-end tests' gRPC client
    libmicrohttpd-dev      # //third_party:microhttpd (the router's /metrics endpoint)
    prometheus             # promtool: tests/e2e/metrics_test.py checks the /metrics text with it
)

missing=()
for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
        missing+=("$p")
    fi
done

if ((${#missing[@]})); then
    echo "install-deps: installing ${missing[*]}"
    if [[ $(id -u) -eq 0 ]]; then
        SUDO=()
    elif command -v sudo >/dev/null; then
        SUDO=(sudo)
    else
        echo "install-deps: not root and no sudo; install as root: ${missing[*]}" >&2
        exit 1
    fi
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    echo "install-deps: all ${#PACKAGES[@]} Debian packages present"
fi

CUDA=/usr/local/cuda
for f in "$CUDA/bin/nvcc" "$CUDA/include/cuda_runtime_api.h" "$CUDA/lib64/libcudart.so" \
         "$CUDA/lib64/libcublas.so" "$CUDA/lib64/libnccl.so" "$CUDA/include/nccl.h"; do
    if [[ ! -e $f ]]; then
        echo "install-deps: $f not found. metrale expects the CUDA 13 toolkit (with cuBLAS and" \
             "NCCL) preinstalled at $CUDA, as on the build hosts; this script does not install it." >&2
        exit 1
    fi
done
echo "install-deps: CUDA toolkit at $(readlink -f "$CUDA") ($("$CUDA/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
