#!/usr/bin/env bash
# Stages what the container image holds under /opt/metrale into OUT, exactly as the Dockerfile's
# runtime stage copies it (COPY --from=build /stage/ /opt/metrale/):
#
#   OUT/bin/     metrale-serve, metrale-router, metrale-worker (metrale-serve finds the other two
#                beside itself)
#   OUT/lib/     every shared library the three need, as ldd resolves them here (the CUDA
#                runtime, cuBLAS, cuBLASLt and NCCL from /usr/local/cuda, gRPC, ZeroMQ, json-c,
#                OpenMP, ...), except glibc's own, which the image's Debian 12 has, and the
#                driver's libcuda, which the NVIDIA container runtime mounts from the node
#   OUT/models/cpu-small/   the default model: tools/configs/cpu-small.json with random weights,
#                the checkpoint metrale-serve makes when it is given no --model
#
# The binaries run from OUT with LD_LIBRARY_PATH=OUT/lib (the image sets it); tests/e2e/image_test.py
# serves a request from a staged folder. Run from the repository root after
#   bazel build //launcher:metrale-serve //tools:mkckpt
# (metrale-serve brings the router and the worker).
#
#   scripts/stage-image.sh [--from DIR] OUT
#     --from DIR  the folder holding launcher/, router/, worker/ and tools/ binaries
#                 (default: bazel-bin)
set -euo pipefail

from=bazel-bin
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --from) from=$2; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) echo "stage-image: unknown option $1" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "stage-image: one OUT folder" >&2; exit 2; }; out=$1; shift ;;
  esac
done
[ -n "$out" ] || { echo "usage: scripts/stage-image.sh [--from DIR] OUT" >&2; exit 2; }

bins=("$from/launcher/metrale-serve" "$from/router/metrale-router" "$from/worker/metrale-worker")
mkckpt=$from/tools/mkckpt
config=tools/configs/cpu-small.json
for f in "${bins[@]}" "$mkckpt"; do
  [ -x "$f" ] || { echo "stage-image: $f not found; bazel build //launcher:metrale-serve //tools:mkckpt" >&2; exit 1; }
done
[ -f "$config" ] || { echo "stage-image: $config not found; run from the repository root" >&2; exit 1; }

# glibc's libraries (the image's libc6 provides them, and they must match its ld.so) and the
# NVIDIA driver's (mounted from the node at run time).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libmvec\.so|libdl\.so|libpthread\.so|librt\.so|libresolv\.so|libutil\.so|libanl\.so|libnsl\.so|libBrokenLocale\.so|libthread_db\.so|libnss_|libcuda\.so|libnvidia-)'

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/models"
for b in "${bins[@]}"; do
  install -m 0755 "$b" "$out/bin/"
  # "libfoo.so.1 => /path/libfoo.so.1 (0x...)"; a "not found" line fails the stage.
  if ldd "$b" | grep -q "not found"; then
    echo "stage-image: $b needs a library that is not installed:" >&2
    ldd "$b" | grep "not found" >&2
    exit 1
  fi
  ldd "$b" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    if ! [[ $name =~ $skip ]]; then install -m 0644 "$path" "$out/lib/$name"; fi
  done
done
# The same seed as metrale-serve's own default checkpoint (launcher/serve.c).
"$mkckpt" --config "$config" --out "$out/models/cpu-small" --seed 1 >/dev/null
chmod -R a+rX "$out"
echo "stage-image: $(du -sh "$out" | cut -f1) in $out ($(ls "$out/lib" | wc -l) libraries)"
