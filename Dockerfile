# kvpool node image: the node and the SDK only (no torch), running as a non-root user.
#   docker build -t kvpool .
#   docker run -p 7700:7700 -p 7701:7701 -v kvpool-data:/data kvpool
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    KVPOOL_HOST=0.0.0.0 KVPOOL_DATA_DIR=/data
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protocol protocol
COPY placement placement
COPY tiers tiers
COPY server server
COPY client client
COPY gpu gpu
COPY bench bench
COPY tests tests
RUN pip install . && useradd --system --uid 10001 --home /data kvpool \
    && mkdir -p /data && chown kvpool /data
USER kvpool
WORKDIR /data
VOLUME /data
EXPOSE 7700 7701
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KVPOOL_ADMIN_PORT', '7701'), timeout=2)"
ENTRYPOINT ["kvpool", "serve"]
