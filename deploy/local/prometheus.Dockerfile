# Prometheus from Debian's prometheus package, on the local Debian base; run like
# prom/prometheus (entrypoint prometheus, data in /prometheus)
ARG BASE_IMAGE=kvpool-local/debian:bookworm
FROM ${BASE_IMAGE}
COPY prometheus /usr/local/bin/prometheus
RUN mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
ENTRYPOINT ["prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml"]
