# etcd from Debian's etcd-server, on the local Debian base (deploy/local/build-images.sh)
ARG BASE_IMAGE=kvpool-local/debian:bookworm
FROM ${BASE_IMAGE}
COPY etcd /usr/local/bin/etcd
VOLUME /etcd-data
ENTRYPOINT []
CMD ["etcd", "--data-dir=/etcd-data"]
