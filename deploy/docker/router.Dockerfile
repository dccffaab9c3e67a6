# syntax=docker/dockerfile:1
# The router image: torch-free and Ray-free (the router never imports either; tests/test_layout.py
# keeps it so). Only the packages the router reaches are copied, and only what they import is
# installed (deploy/docker/router-requirements.txt; tests/test_docker.py checks the list).
# Build from the repository root:
#   docker build -f deploy/docker/router.Dockerfile -t pdserve/router:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/router
ENV PATH=/opt/router/bin:$PATH
COPY deploy/docker/router-requirements.txt /tmp/router-requirements.txt
# at the versions CI tested (requirements/lock.txt as constraints)
COPY requirements/lock.txt /tmp/lock.txt
RUN pip install -c /tmp/lock.txt -r /tmp/router-requirements.txt

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/router/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app
RUN groupadd --gid 1000 pdserve \
    && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin pdserve
COPY --from=build /opt/router /opt/router
WORKDIR /app
COPY tokens tokens
COPY kv_index kv_index
COPY protos protos
COPY telemetry telemetry
COPY security security
COPY settings settings
COPY router router
COPY tool_calling tool_calling
COPY frontend frontend
USER 1000:1000
EXPOSE 50051 8000
ENTRYPOINT ["python", "-m", "frontend.server"]
CMD ["--help"]
