"""The Docker Compose deployment, checked without a Docker engine: the files parse, every
node's environment is accepted by the real config loader, ports, the cluster and Prometheus'
targets agree, and every metric the Grafana dashboard queries is one a real node exports."""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.client import Client
from kvpool.server.config import load_config, unknown_env_vars

from .conftest import start_node

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    return data


def kvpool_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if name.startswith("kvpool")}


def test_compose_has_the_whole_stack(compose: dict[str, Any]) -> None:
    services = set(compose["services"])
    assert {"etcd", "minio", "minio-init", "otel-collector", "prometheus", "grafana"} <= services
    nodes = kvpool_services(compose)
    assert len(nodes) == 3
    for name, svc in nodes.items():
        assert svc["build"]["dockerfile"] == "Dockerfile"
        assert (DEPLOY / svc["build"]["context"] / "Dockerfile").is_file()
        assert svc["volumes"] == [f"{name}-data:/data"] and f"{name}-data" in compose["volumes"]
        assert svc["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    for svc in compose["services"].values():  # every mounted config file exists
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), source


def test_every_node_environment_is_accepted_by_the_config_loader(
        compose: dict[str, Any]) -> None:
    ids = set()
    for name, svc in kvpool_services(compose).items():
        env = {k: str(v) for k, v in svc["environment"].items()}
        assert unknown_env_vars(env) == [], name
        config = load_config(None, env)  # raises on any bad value
        assert config.server.node_id == name and config.server.advertise_host == name
        assert config.cluster.etcd == "http://etcd:2379"
        assert config.s3.bucket == "kvpool" and config.s3.endpoint_url == "http://minio:9000"
        # the published ports lead to the ports the node listens on
        published = {int(p.split(":")[1]) for p in svc["ports"]}
        assert published == {config.server.data_port, config.server.admin_port}
        ids.add(config.server.node_id)
    assert len(ids) == 3
    minio = compose["services"]["minio"]["environment"]
    node_env = next(iter(kvpool_services(compose).values()))["environment"]
    assert node_env["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"]
    assert node_env["AWS_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"]
    assert "local/kvpool" in " ".join(compose["services"]["minio-init"]["command"])


def test_prometheus_scrapes_every_node_admin_port(compose: dict[str, Any]) -> None:
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    expected = set()
    for name, svc in kvpool_services(compose).items():
        config = load_config(None, {k: str(v) for k, v in svc["environment"].items()})
        expected.add(f"{name}:{config.server.admin_port}")
    assert targets == expected
    assert all(job["metrics_path"] == "/metrics" for job in prometheus["scrape_configs"])


def test_otel_collector_receives_what_the_nodes_send(compose: dict[str, Any]) -> None:
    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    for svc in kvpool_services(compose).values():
        endpoint = svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert endpoint == f"http://otel-collector:{http.rsplit(':', 1)[1]}"
    assert set(collector["service"]["pipelines"]) >= {"metrics", "traces"}


def test_dashboard_queries_only_metrics_a_real_node_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "kvpool.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    wanted = {m for e in exprs for m in re.findall(r"\bkvpool_[a-z_]+", e)}
    assert len(wanted) >= 10
    node = start_node("--dram-capacity", "32MiB")
    try:
        with Client(node.url) as c:  # traffic, so that every labelled series exists
            keys = [os.urandom(16) for _ in range(4)]
            c.put_many(keys, [b"x" * 100] * 4, num_tokens=16)
            c.get_many(keys)
        with urllib.request.urlopen(f"{node.admin_url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        node.stop()
    exported = set(re.findall(r"^(kvpool_[a-z_]+)", text, re.MULTILINE))
    assert sorted(wanted - exported) == []
    titles = {p["title"] for p in dashboard["panels"]}
    for needed in ("Hit rate by tier", "Request latency p50 / p99", "Tier usage", "Errors",
                   "Evictions, demotions, promotions", "Bytes sent and received"):
        assert needed in titles
    assert any("prefill_tokens_served" in e for e in exprs)
