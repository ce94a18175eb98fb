# metrale's container image: metrale-serve with the router and the worker, on Debian 12.
#
#   docker build -t metrale:0.1.0 .
#   docker run --gpus all -p 50051:50051 metrale:0.1.0                 (one GPU worker)
#   docker run -p 50051:50051 metrale:0.1.0 --listen 0.0.0.0:50051 --backend cpu \
#       --model /opt/metrale/models/cpu-small                           (the CPU backend)
#
# The build stage builds offline with Bazel as scripts/run.sh does, then scripts/stage-image.sh
# stages /opt/metrale: the binaries, the shared libraries they need (the CUDA runtime, cuBLAS and
# NCCL included; the driver's libcuda comes from the node through the NVIDIA container runtime)
# and the default model. The runtime stage copies that folder and nothing else;
# tests/e2e/image_test.py serves requests from a folder staged the same way.

# ---- build ----
FROM debian:12 AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# pip for the CUDA wheels; then the CUDA 13 toolkit at /usr/local/cuda as on the build hosts
# (pinned NVIDIA wheels) and the Debian packages of scripts/install-deps.sh, which checks the
# toolkit. Both scripts come in alone first, so a change in the sources keeps these layers.
# Debian packages are not pinned (DL3008): Debian 12's point releases replace their versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates python3-pip \
    && rm -rf /var/lib/apt/lists/*
COPY scripts/install-cuda.sh scripts/install-deps.sh /tmp/
RUN /tmp/install-cuda.sh /usr/local/cuda-13.0 \
    && ln -s /usr/local/cuda-13.0 /usr/local/cuda \
    && /tmp/install-deps.sh \
    && rm -rf /var/lib/apt/lists/* /tmp/install-cuda.sh /tmp/install-deps.sh

WORKDIR /src
COPY . .
RUN bazel build //launcher:metrale-serve //tools:mkckpt \
    && scripts/stage-image.sh /stage \
    && bazel shutdown

# ---- runtime ----
FROM debian:12-slim

COPY --from=build /stage/ /opt/metrale/

# 65532: a user with no account and no home; HOME=/tmp is an emptyDir in the Helm chart (the
# root filesystem is read-only there). metrale-serve puts its ZeroMQ socket in /tmp.
ENV PATH=/opt/metrale/bin:$PATH \
    LD_LIBRARY_PATH=/opt/metrale/lib \
    HOME=/tmp \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 65532:65532
WORKDIR /tmp
EXPOSE 50051
ENTRYPOINT ["/opt/metrale/bin/metrale-serve"]
CMD ["--listen", "0.0.0.0:50051", "--model", "/opt/metrale/models/cpu-small"]
