# kvpool node image: the node and the SDK only (no torch), in a venv, running as a non-root
# user, healthy when the node answers /healthz.
#   docker build -t kvpool .
#   docker run --network host -v kvpool-data:/data kvpool     # on 127.0.0.1 only, open mode
# It binds 127.0.0.1 unless KVPOOL_HOST says otherwise, and runs in open mode (anyone who
# reaches its ports reads and writes every chunk) unless given a tokens file. To serve
# other machines, give both, the token files as files (docs/deploy.md):
#   docker run --network host -e KVPOOL_HOST=10.0.0.5 -v kvpool-data:/data \
#       -v "$PWD/secrets:/secrets:ro" -e KVPOOL_AUTH_TOKENS=/secrets/tokens.toml \
#       -e KVPOOL_PEER_TOKEN_FILE=/secrets/admin-token kvpool
# BASE_IMAGE: any Debian-like image with python3 >= 3.11 and its venv module (default
# python:3.11-slim; offline, a local debootstrapped Debian: deploy/local/build-images.sh).
# A wheels/ folder in the build context (pip wheel --wheel-dir wheels '.[server]') is installed with
# --no-index, so the build needs no package index; without one, pip uses the index.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# the legacy builder keeps this stage as an untagged image: the label lets it be pruned
LABEL io.kvpool.stage=build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
COPY . /src
RUN python3 -m venv /opt/kvpool \
    && if [ -d /src/wheels ]; then \
           /opt/kvpool/bin/pip install --no-index --find-links /src/wheels 'kvpool[server]'; \
       else \
           /opt/kvpool/bin/pip install '/src[server]'; \
       fi \
    && /opt/kvpool/bin/python -c "import importlib.util as u, sys; \
sys.exit('torch is in the image' if u.find_spec('torch') else 0)"

FROM ${BASE_IMAGE}
ENV PATH=/opt/kvpool/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    KVPOOL_HOST=127.0.0.1 KVPOOL_DATA_DIR=/data
COPY --from=build /opt/kvpool /opt/kvpool
RUN useradd --system --uid 10001 --user-group --home-dir /data --no-create-home kvpool \
    && mkdir -p /data && chown kvpool:kvpool /data
USER kvpool
WORKDIR /data
VOLUME /data
EXPOSE 7700 7701
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["kvpool", "health", "--quiet"]
ENTRYPOINT ["kvpool", "serve"]
