"""The Docker Compose deployment, checked without a Docker engine: the files parse, every
node's environment is accepted by the real config loader, ports, the cluster and Prometheus'
targets agree, the local override swaps only images, and every metric the Grafana dashboard
queries is one a real node exports. tests/deploy/test_docker.py runs the stack for real."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.client import Client
from kvpool.server.config import load_config, unknown_env_vars
from kvpool.server.security.auth import Role, load_tokens
from tests.conftest import ROOT, start_node

DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def kvpool_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if name.startswith("kvpool")}


SECRETS_VOLUME = "${KVPOOL_SECRETS:-kvpool-secrets}:/secrets:ro"


def interpolated(value: Any) -> str:
    """A Compose value with ``${VAR:-default}`` as Compose reads it with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the stack's ``secrets`` service generates, made by the same script."""
    folder = tmp_path_factory.mktemp("secrets")
    for _ in range(2):  # a second start keeps every file
        subprocess.run([sys.executable, str(DEPLOY / "init-stack.py"), "secrets"], check=True,
                       env={**os.environ, "SECRETS_DIR": str(folder)}, timeout=60)
    return folder


def node_env(svc: dict[str, Any], secrets: Path) -> dict[str, str]:
    """A node service's environment as its container sees it (the secrets volume at
    ``secrets``)."""
    return {k: interpolated(v).replace("/secrets/", f"{secrets}/")
            for k, v in svc["environment"].items()}


def test_compose_has_the_whole_stack(compose: dict[str, Any]) -> None:
    services = set(compose["services"])
    assert {"secrets", "etcd", "etcd-init", "minio", "minio-init", "otel-collector",
            "prometheus", "grafana"} <= services
    nodes = kvpool_services(compose)
    assert len(nodes) == 3
    for name, svc in nodes.items():
        assert svc["build"]["dockerfile"] == "Dockerfile"
        assert (ROOT / svc["build"]["context"] / "Dockerfile").is_file()
        assert svc["volumes"] == [f"{name}-data:/data", SECRETS_VOLUME]
        assert f"{name}-data" in compose["volumes"]
        for init in ("etcd-init", "minio-init"):
            assert svc["depends_on"][init]["condition"] == "service_completed_successfully"
    for svc in compose["services"].values():
        # host networking (clients on the host reach the addresses nodes advertise), so no
        # published ports: Compose v1 refuses them beside network_mode host
        assert svc["network_mode"] == "host" and "ports" not in svc
        for volume in svc.get("volumes", []):  # every mounted config file exists
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source


def test_every_node_environment_is_accepted_by_the_config_loader(
        compose: dict[str, Any], secrets_dir: Path) -> None:
    ids: set[str] = set()
    ports: set[int] = set()
    for name, svc in kvpool_services(compose).items():
        env = node_env(svc, secrets_dir)
        assert unknown_env_vars(env) == [], name
        config = load_config(None, env)  # raises on any bad value, or a missing secret
        assert config.server.node_id == name and config.server.host == "127.0.0.1"
        assert config.cluster.etcd == "http://127.0.0.1:2379"
        assert config.s3.bucket == "kvpool" and config.s3.endpoint_url == "http://127.0.0.1:9000"
        ids.add(config.server.node_id)
        ports.update({config.server.data_port, config.server.admin_port})
    assert len(ids) == 3 and len(ports) == 6  # one network: every node its own ports
    seeds = re.search(r"seeds +(kvpool://\S+)", (ROOT / "docker-compose.yml").read_text())
    assert seeds is not None
    data_ports = sorted(load_config(None, node_env(svc, secrets_dir)).server.data_port
                        for svc in kvpool_services(compose).values())
    assert seeds[1] == "kvpool://" + ",".join(f"127.0.0.1:{p}" for p in data_ports)
    assert "local/kvpool" in " ".join(compose["services"]["minio-init"]["command"])


def test_the_stack_is_secure_by_default(compose: dict[str, Any], secrets_dir: Path) -> None:
    """Nodes with tokens and an etcd login; no credential in the file or any service's
    environment (only paths to the secrets volume); every image pinned; descriptor
    limits set; the nodes' S3 key is not MinIO's root key."""
    for name, svc in compose["services"].items():
        image = svc["image"]
        assert (":" in image and not image.endswith(":latest")) or image == "kvpool:latest", name
        for key, value in (svc.get("environment") or {}).items():
            if re.search(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY", key):
                assert key.endswith(("_FILE", "__FILE")) or str(value).startswith("/secrets/"), \
                    (name, key)
    for svc in kvpool_services(compose).values():
        config = load_config(None, node_env(svc, secrets_dir))
        assert config.security.auth_tokens and config.security.peer_token
        assert config.cluster.etcd_user and config.cluster.etcd_password
        nofile = svc["ulimits"]["nofile"]
        assert min(nofile["soft"], nofile["hard"]) >= \
            config.server.max_connections + config.server.admin_max_connections + 256
    table = load_tokens(str(secrets_dir / "tokens.toml"))
    for name, role in [("admin-token", Role.ADMIN), ("client-token", Role.WRITE)]:
        principal = table.authenticate((secrets_dir / name).read_text().strip())
        assert principal is not None and principal.role == role
    assert "token" not in tomllib.loads((secrets_dir / "tokens.toml").read_text())["token"][0]
    credentials = (secrets_dir / "aws-credentials").read_text()
    assert (secrets_dir / "s3-node-key").read_text().strip() in credentials
    assert (secrets_dir / "s3-root-password").read_text().strip() not in credentials
    assert all(oct(p.stat().st_mode)[-3:] == "640" for p in secrets_dir.iterdir())


def test_prometheus_scrapes_every_node_admin_port(compose: dict[str, Any],
                                                 secrets_dir: Path) -> None:
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    expected = set()
    for svc in kvpool_services(compose).values():
        config = load_config(None, node_env(svc, secrets_dir))
        expected.add(f"{config.server.host}:{config.server.admin_port}")
    assert targets == expected
    assert all(job["metrics_path"] == "/metrics" for job in prometheus["scrape_configs"])


def test_otel_collector_receives_what_the_nodes_send(compose: dict[str, Any]) -> None:
    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    for svc in kvpool_services(compose).values():
        endpoint = svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert endpoint == f"http://{http}"
    assert set(collector["service"]["pipelines"]) >= {"metrics", "traces"}


def test_the_local_override_swaps_images_and_nothing_of_the_deployment(
        compose: dict[str, Any]) -> None:
    """docker-compose.local.yml (what CI runs) may change how a service is made and started,
    never its network, volumes, or a node's configuration."""
    local = yaml.safe_load((ROOT / "docker-compose.local.yml").read_text())
    assert set(local) == {"services"}
    for name, svc in local["services"].items():
        assert name in compose["services"], name
        assert set(svc) <= {"image", "build", "entrypoint", "command", "environment"}, name
        if name.startswith("kvpool"):
            assert set(svc) == {"build", "environment"}
            assert set(svc["build"]) == {"args"}
            assert svc["environment"] == {"OTEL_EXPORTER_OTLP_ENDPOINT": ""}
        elif "image" in svc:
            assert svc["image"].startswith(("kvpool-local/", "kvpool:")), name
    built = {svc["image"] for svc in local["services"].values() if "image" in svc}
    script = (DEPLOY / "local" / "build-images.sh").read_text()
    assert all(image in script for image in built - {"kvpool:latest"})


def test_grafana_and_prometheus_agree_on_the_address(compose: dict[str, Any]) -> None:
    source = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    url = source["datasources"][0]["url"]
    listen = next(a for a in compose["services"]["prometheus"]["command"]
                  if a.startswith("--web.listen-address="))
    assert url == "http://" + listen.split("=", 1)[1]


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
