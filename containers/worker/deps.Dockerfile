# The worker image's dependency layer (built by `testbed image build`, tagged testbed-worker-deps:KEY).
#
# BASE is python:3.11-slim (registry path) or testbed-base:bookworm (debootstrap path, no registry needed).
# Python packages come from wheels the HOST's pip downloaded (so the host's index and its CPU build of torch
# apply) and serves at WHEELS_URL on 127.0.0.1 for the duration of the build (docker build --network host):
# nothing is fetched from an index inside, and no wheel stays in a layer. requirements.txt pins exactly the
# versions the host environment has.
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1

# System tools: already in the debootstrap base (then this step needs no network); apt on python:3.11-slim.
RUN set -eu; need=""; \
    for cp in ip:iproute2 iptables:iptables ethtool:ethtool ping:iputils-ping ps:procps; do \
        command -v "${cp%%:*}" >/dev/null 2>&1 || need="$need ${cp#*:}"; done; \
    [ -f /etc/ssl/certs/ca-certificates.crt ] || need="$need ca-certificates"; \
    command -v python3.11 >/dev/null 2>&1 || need="$need python3 python3-venv"; \
    if [ -n "$need" ]; then \
        apt-get update -qq && apt-get install -y -qq --no-install-recommends $need && rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3.11 -m venv /opt/venv

ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin VIRTUAL_ENV=/opt/venv

COPY requirements.txt /opt/testbed/requirements.txt
ARG WHEELS_URL
# Byte-code is compiled once here, in parallel (every container would otherwise compile torch on first import).
# The testbed package itself is added by ./Dockerfile as the last layer, under /opt/testbed/src (a .pth file
# puts it on sys.path); `testbed` runs its CLI.
RUN set -eu; test -n "$WHEELS_URL"; \
    pip install -q --no-compile --no-index --find-links "$WHEELS_URL" -r /opt/testbed/requirements.txt; \
    site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
    python -m compileall -q -j 0 "$site" >/dev/null || true; \
    echo /opt/testbed/src > "$site/testbed.pth"; \
    printf '#!/bin/sh\nexec python -m testbed "$@"\n' > /opt/venv/bin/testbed; chmod 755 /opt/venv/bin/testbed; \
    mkdir -p /opt/testbed/src /var/lib/testbed/work; \
    python -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'
