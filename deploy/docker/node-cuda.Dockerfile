# syntax=docker/dockerfile:1
# The CUDA node image: prefill and decode nodes on NVIDIA GPUs, torch's CUDA build and flashinfer
# (the paged-attention backend on CUDA). flashinfer compiles a kernel the first time it is used
# unless a pre-built one exists: the devel base keeps nvcc for that, flashinfer-cubin ships the
# common ones pre-built. Build from the repository root:
#   docker build -f deploy/docker/node-cuda.Dockerfile -t pdserve/node-cuda:0.1.0 .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

FROM ${CUDA_IMAGE}
ARG TORCH_VERSION=2.13.0
# PyTorch's wheel index for this CUDA (cu128 for the 12.8 base above).
ARG TORCH_CUDA=cu128
ARG FLASHINFER_VERSION=0.6.12
# Ray's version is the RayCluster's spec.rayVersion (the chart's ray.version): keep them equal.
ARG RAY_VERSION=2.60.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDSERVE_CACHE_DIR=/cache \
    HF_HUB_OFFLINE=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev wget \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/pdserve \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && groupadd --gid 1000 pdserve \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash pdserve \
    && mkdir -p /cache /models \
    && chown pdserve:pdserve /cache /models
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
# The versions CI tested (requirements/lock.txt) as constraints, less its torch (the CPU build):
# this image's torch is the CUDA build of the same release, installed above.
COPY requirements/lock.txt requirements/
COPY tokens tokens
COPY engine engine
COPY kv_index kv_index
COPY kv_transfer kv_transfer
COPY node node
COPY prefill_node prefill_node
COPY decode_node decode_node
COPY router router
COPY tool_calling tool_calling
COPY frontend frontend
COPY pdserve pdserve
COPY protos protos
COPY telemetry telemetry
COPY security security
COPY settings settings
COPY deploy deploy
COPY bench bench
COPY chaos chaos
# the project itself, from this build context, and pinned flashinfer packages
# hadolint ignore=DL3013
RUN grep -v '^torch==' requirements/lock.txt > /tmp/constraints.txt \
    && pip install -c /tmp/constraints.txt ".[gpu]" "ray[default]==${RAY_VERSION}" "flashinfer-python==${FLASHINFER_VERSION}" "flashinfer-cubin==${FLASHINFER_VERSION}"
USER 1000:1000
WORKDIR /home/pdserve
CMD ["pdserve", "--help"]
