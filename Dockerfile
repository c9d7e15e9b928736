# The cachefs image: the node plugin (CSI + FUSE sessions), the label publisher, the CSI controller and the
# scheduler extender are all `cachefs <command>`.
# BASE: any Debian-based image with Python 3.11+ and pip (a registry's python:3.11-slim by default; the node tier
# builds one from Debian's packages with mmdebstrap where no registry is reachable: tests/node/images/build.sh).
ARG BASE=python:3.11-slim
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends fuse3 util-linux \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir . && rm -rf /src
WORKDIR /
ENTRYPOINT ["cachefs"]
