# syntax=docker/dockerfile:1
# shmserve's image: the service and its command line in the virtual environment /opt/shmserve,
# run as the non-root user 1000:1000 (the uid deploy/kserve/ runs it as).
#
#   docker build -t shmserve:0.1.0 .                                      # CPU (the default)
#   docker build -t shmserve:0.1.0-cuda --build-arg VARIANT=cuda .        # CUDA: GPU workers
#   docker run --rm --shm-size=512m shmserve:0.1.0                         # the demo model
#
# /dev/shm holds the arena (about 190 MiB with the default limits; `shmserve info` says) and
# docker gives a container 64 MiB: give it --shm-size (Kubernetes: an emptyDir of medium Memory
# at /dev/shm, as deploy/kserve/ does).  Build arguments: VARIANT (cpu or cuda), EXTRAS (the
# pip extras; default grpc, and for cuda grpc,gpu,tensorrt), CPU_BASE and CUDA_BASE (the base
# images).  What this file was checked with: docs/scale-out.md, "The image".

ARG VARIANT=cpu
ARG CPU_BASE=python:3.12-slim-bookworm
ARG CUDA_BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${CPU_BASE} AS base-cpu
FROM ${CUDA_BASE} AS base-cuda

# hadolint ignore=DL3006
FROM base-${VARIANT} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Python (3.11 or newer) with venv where the base has none (the CUDA image): the distribution's.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

FROM base AS build
ARG VARIANT
ARG EXTRAS=""
# The C extensions (shmserve/_atomics.c, _hotpath.c) need a compiler and Python's headers (the
# python image has them; the distribution's Python needs python3-dev).
# hadolint ignore=DL3008
RUN headers=""; if [ "$VARIANT" = cuda ]; then headers=python3-dev; fi \
    && apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev ${headers:+"$headers"} \
    && rm -rf /var/lib/apt/lists/*
COPY . /src
# hadolint ignore=DL3013
RUN extras="${EXTRAS:-$([ "$VARIANT" = cuda ] && echo grpc,gpu,tensorrt || echo grpc)}" \
    && python3 -m venv /opt/shmserve \
    && /opt/shmserve/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/shmserve/bin/pip install --no-cache-dir "/src[$extras]" \
    && /opt/shmserve/bin/shmserve --version

FROM base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=build /opt/shmserve /opt/shmserve
# uid and gid 1000, whoever held them in the base image (the CUDA one has a user 'ubuntu' there)
RUN set -eu; \
    user="$(getent passwd 1000 || true)"; if [ -n "$user" ]; then userdel "${user%%:*}"; fi; \
    group="$(getent group 1000 || true)"; if [ -n "$group" ]; then groupdel "${group%%:*}"; fi; \
    groupadd --gid 1000 shmserve; \
    useradd --uid 1000 --gid 1000 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin shmserve
# shmserve and python3 (the probes' interpreter) from the virtual environment first; no .pyc
# written, so a read-only root file system is fine (the socket goes under /tmp).
ENV PATH=/opt/shmserve/bin:$PATH PYTHONDONTWRITEBYTECODE=1
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["shmserve"]
CMD ["serve"]
