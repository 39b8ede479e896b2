"""The Docker image and the Compose stack, for real: a Docker engine builds the image on a
local Debian base (no registry is reachable here), and docker-compose.yml runs with
docker-compose.local.yml on top (only unpullable images swapped): etcd, SeaweedFS as the
S3 tier, three nodes, Prometheus. The SDK on the host drives it through the seeds.

Needs root, Docker (docker.io, docker-compose), debootstrap, and Debian's etcd-server and
prometheus (``.ci/run`` installs them). Starts ``dockerd`` when none runs and stops it
after; removes every container, volume and image it made. Skipped when Docker cannot run,
except in CI, where that fails.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import botocore.exceptions
import pytest

from kvpool.client import AuthenticationError, Client
from kvpool.protocol.envelope import seal
from kvpool.server.security.auth import scope_key
from kvpool.tiers.s3 import object_name
from tests.conftest import ROOT

PROJECT = "kvpooltest"
FILES = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "docker-compose.local.yml")]
SERVICES = ["secrets", "etcd", "etcd-init", "minio", "minio-init", "kvpool-1", "kvpool-2",
            "kvpool-3", "prometheus"]
NODES = {"kvpool-1": (7700, 7701), "kvpool-2": (7710, 7711), "kvpool-3": (7720, 7721)}
SEEDS = [f"kvpool://127.0.0.1:{data}" for data, _ in NODES.values()]
BASE = "kvpool-local/debian:bookworm"
LOCAL_IMAGES = [BASE, "kvpool-local/etcd", "kvpool-local/seaweedfs", "kvpool-local/prometheus"]
IMAGE = "kvpool:latest"
#: every port the stack binds on 127.0.0.1 (host networking)
PORTS = [p for pair in NODES.values() for p in pair] + [2379, 2380, 9000, 9090, 9333, 8080,
                                                        8888, 19000, 19333, 18080, 18888]
#: what the stack's secrets service generated (read from a node container: ``secrets``)
SECRETS: dict[str, str] = {}

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # images, containers and a Compose stack


def unavailable(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"Docker test cannot run in CI: {why}")
    pytest.skip(why)


def run(*cmd: str, timeout: float = 300, check: bool = True) -> str:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}:\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def succeeds(*cmd: str, timeout: float = 300) -> bool:
    return subprocess.run(cmd, check=False, capture_output=True, timeout=timeout,
                          cwd=ROOT).returncode == 0


def compose(*args: str, timeout: float = 300, check: bool = True) -> str:
    return run(*COMPOSE, "-p", PROJECT, *FILES, *args, timeout=timeout, check=check)


def container(service: str) -> str:
    return compose("ps", "-q", service).strip()


def inspect(ref: str, fmt: str) -> str:
    return run("docker", "inspect", "-f", fmt, ref).strip()


def wait_for(what: str, check: Callable[[], bool], timeout: float = 90) -> None:
    """Until ``check()``; a refused connection counts as not yet: a recreated node's map
    entry can say "up" (its lease has not run out) before the new container listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def http_json(url: str, token: str | None = None) -> Any:
    """GET with the stack's admin token (its nodes refuse a read without one)."""
    token = SECRETS.get("admin-token", "") if token is None else token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                timeout=5) as reply:
        return json.load(reply)


def client(seeds: list[str], **options: Any) -> Client:
    """A client with the stack's write token."""
    return Client(seeds, token=SECRETS["client-token"], **options)


def node_states() -> dict[str, str]:
    for _, admin in NODES.values():
        try:
            return {n["id"]: n["state"]
                    for n in http_json(f"http://127.0.0.1:{admin}/v1/cluster")["nodes"]}
        except OSError:
            continue
    return {}


def ssd_stats(service: str) -> dict[str, Any]:
    stats: dict[str, Any] = http_json(
        f"http://127.0.0.1:{NODES[service][1]}/v1/stats")["tiers"]["ssd"]
    return stats


def port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


COMPOSE: list[str] = []


@pytest.fixture(scope="module")
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if shutil.which("docker") is None:
        unavailable("no docker client (apt-get install docker.io)")
    if shutil.which("docker-compose"):
        COMPOSE[:] = ["docker-compose"]
    elif succeeds("docker", "compose", "version"):
        COMPOSE[:] = ["docker", "compose"]
    else:
        unavailable("no docker-compose (apt-get install docker-compose)")
    daemon = None
    if not succeeds("docker", "info", timeout=30):
        if shutil.which("dockerd") is None or os.geteuid() != 0:
            unavailable("no Docker engine runs, and this user cannot start dockerd")
        log = (tmp_path_factory.mktemp("dockerd") / "dockerd.log").open("w")
        # no bridge: these machines allow no traffic to private ranges; host networking only
        daemon = subprocess.Popen(["dockerd", "--iptables=false", "--bridge=none"],
                                  stdout=log, stderr=subprocess.STDOUT)
        wait_for("dockerd", lambda: succeeds("docker", "info") or daemon.poll() is not None,
                 timeout=60)
        if daemon.poll() is not None:
            unavailable(f"dockerd exited {daemon.returncode}: see {log.name}")
    try:
        yield
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(60)


@pytest.fixture(scope="module")
def stack(docker_engine: None) -> Iterator[dict[str, Any]]:
    busy = [p for p in PORTS if port_busy(p)]
    if busy:
        unavailable(f"ports the stack binds on 127.0.0.1 are in use: {busy}")
    existing = {ref for ref in [*LOCAL_IMAGES, IMAGE]
                if succeeds("docker", "image", "inspect", ref)}
    made_wheels = not (ROOT / "wheels").exists()
    info: dict[str, Any] = {}
    try:
        started = time.monotonic()
        run(str(ROOT / "deploy" / "local" / "build-images.sh"), timeout=600)
        info["local_images_s"] = time.monotonic() - started
        started = time.monotonic()
        compose("build", "kvpool-1", timeout=600)
        info["build_s"] = time.monotonic() - started
        compose("up", "-d", *SERVICES, timeout=300)
        yield info
    finally:
        print(compose("logs", "--no-color", "--tail=30", check=False)[-6000:])
        compose("down", "-v", "--remove-orphans", "-t", "30", check=False)
        made = [ref for ref in [IMAGE, *LOCAL_IMAGES] if ref not in existing]
        if made:
            run("docker", "rmi", "-f", *made, check=False)
        run("docker", "image", "prune", "-f", "--filter", "label=io.kvpool.stage=build",
            check=False)
        if made_wheels:
            shutil.rmtree(ROOT / "wheels", ignore_errors=True)


@pytest.fixture(scope="module")
def secrets(stack: dict[str, Any]) -> dict[str, str]:
    """The credentials the stack generated on its first start, once every node is healthy
    (read inside a node container: they are in no file or environment of the host)."""
    for service in NODES:
        wait_for(f"{service} healthy", lambda s=service: inspect(  # type: ignore[misc]
            container(s), "{{.State.Health.Status}}") == "healthy", timeout=120)
    for name in ("admin-token", "client-token", "s3-root-user", "s3-root-password"):
        SECRETS[name] = compose("exec", "-T", "kvpool-1", "cat", f"/secrets/{name}").strip()
    return SECRETS


@pytest.fixture(scope="module")
def chunks(secrets: dict[str, str]) -> dict[bytes, bytes]:
    """Chunks written through the seeds once every node is healthy and in the map."""
    wait_for("3 nodes up in the map", lambda: sorted(node_states().values()) == ["up"] * 3)
    data = {os.urandom(16): os.urandom(40_000 + i) for i in range(90)}
    with client(SEEDS) as c:
        c.put_many(list(data), list(data.values()))
        assert c.get_many(list(data)) == list(data.values())
    return data


def test_image_is_small_runs_as_a_user_and_holds_no_torch(stack: dict[str, Any]) -> None:
    size = int(inspect(IMAGE, "{{.Size}}"))
    base = int(inspect(BASE, "{{.Size}}"))
    over = (size - base) / 1e6
    print(f"image {IMAGE}: {size / 1e6:.0f} MB, {over:.0f} MB over {BASE} "
          f"({base / 1e6:.0f} MB); local images {stack['local_images_s']:.0f} s, "
          f"build {stack['build_s']:.0f} s")
    assert over <= 300
    assert run("docker", "run", "--rm", "--entrypoint", "id", IMAGE, "-u").strip() != "0"
    probe = ("import importlib.util as u; import kvpool.server.node; "
             "print(u.find_spec('torch') is None)")
    assert run("docker", "run", "--rm", "--entrypoint", "python", IMAGE, "-c",
               probe).strip() == "True"
    assert inspect(IMAGE, "{{json .Config.Healthcheck.Test}}") == \
        '["CMD","kvpool","health","--quiet"]'


def test_nodes_get_healthy_join_through_etcd_and_serve_the_sdk(
        chunks: dict[bytes, bytes]) -> None:
    for service in NODES:  # the image's own HEALTHCHECK ran kvpool health in each
        log = json.loads(inspect(container(service), "{{json .State.Health.Log}}"))
        assert log and log[-1]["ExitCode"] == 0
    assert node_states() == {name: "up" for name in NODES}
    with client(SEEDS[1:2]) as c:  # any one seed finds the whole cluster
        assert c.get_many(list(chunks)) == list(chunks.values())
        assert c.epoch > 0
    for _, admin in NODES.values():
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5) as r:
            assert b"kvpool_requests" in r.read()


def test_prometheus_scrapes_every_node_with_the_repository_config(
        chunks: dict[bytes, bytes]) -> None:
    def targets() -> dict[str, str]:
        try:
            reply = http_json("http://127.0.0.1:9090/api/v1/targets")
        except OSError:
            return {}
        return {t["scrapeUrl"]: t["health"] for t in reply["data"]["activeTargets"]}

    wait_for("Prometheus targets up", lambda: list(targets().values()) == ["up"] * 3,
             timeout=90)
    assert set(targets()) == {f"http://127.0.0.1:{a}/metrics" for _, a in NODES.values()}


def test_a_killed_node_leaves_every_chunk_readable_and_restart_brings_it_back(
        chunks: dict[bytes, bytes]) -> None:
    victim = container("kvpool-2")
    run("docker", "kill", victim)
    seeds = [SEEDS[0], SEEDS[2]]
    with client(seeds) as c:
        assert c.get_many(list(chunks)) == list(chunks.values())  # at once, from replicas
    wait_for("kvpool-2 marked down", lambda: node_states().get("kvpool-2") == "down")
    with client(seeds) as c:
        assert c.get_many(list(chunks)) == list(chunks.values())
    run("docker", "restart", victim)
    wait_for("kvpool-2 up again", lambda: node_states().get("kvpool-2") == "up")
    wait_for("kvpool-2 healthy", lambda: inspect(victim, "{{.State.Health.Status}}")
             == "healthy", timeout=120)
    with client(SEEDS) as c:
        assert c.get_many(list(chunks)) == list(chunks.values())


def test_a_recreated_container_keeps_its_ssd_tier_in_its_volume(
        chunks: dict[bytes, bytes]) -> None:
    wait_for("kvpool-3's SSD writes", lambda: ssd_stats("kvpool-3")["pending_writes"] == 0
             and ssd_stats("kvpool-3")["num_objects"] > 0)
    before = ssd_stats("kvpool-3")["num_objects"]
    old = container("kvpool-3")
    compose("up", "-d", "--no-deps", "--force-recreate", "kvpool-3")
    assert container("kvpool-3") != old
    wait_for("kvpool-3 up again", lambda: node_states().get("kvpool-3") == "up"
             and ssd_stats("kvpool-3")["num_objects"] > 0)
    assert ssd_stats("kvpool-3")["num_objects"] == before
    tiers = {k: _chunk_tiers(NODES["kvpool-3"][1], k) for k in chunks}
    assert sum("ssd" in t for t in tiers.values()) == before  # all from the volume
    assert not any("dram" in t for t in tiers.values())  # a new container: DRAM empty
    with client(SEEDS) as c:
        assert c.get_many(list(chunks)) == list(chunks.values())


def _chunk_tiers(admin: int, key: bytes) -> list[str]:
    try:
        info = http_json(f"http://127.0.0.1:{admin}/v1/chunks/{key.hex()}",
                         token=SECRETS["client-token"])  # the key in the writer's scope
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return []
        raise
    tiers: list[str] = info["tiers"]
    return tiers


def test_the_s3_tier_is_one_bucket_shared_by_the_nodes(chunks: dict[bytes, bytes]) -> None:
    s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:9000", region_name="us-east-1",
                      aws_access_key_id=SECRETS["s3-root-user"],
                      aws_secret_access_key=SECRETS["s3-root-password"])

    def stored() -> set[str]:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket="kvpool")
        return {o["Key"] for page in pages for o in page.get("Contents", [])}

    # stored under the client token's tenant (deploy/init-stack.py names it)
    names = {object_name("kvpool", scope_key("engines", k)) for k in chunks}
    wait_for("every chunk in the bucket", lambda: names <= stored())
    late = os.urandom(16)  # written by someone else, after every node's LIST
    s3.put_object(Bucket="kvpool", Key=object_name("kvpool", late),
                  Body=seal(b"late chunk") + b"late chunk")
    with Client(SEEDS, token=SECRETS["admin-token"], scope="raw") as c:  # its stored key
        assert c.get(late) == b"late chunk"  # a GET miss asks the shared bucket


def test_the_stack_refuses_whoever_has_no_token(chunks: dict[bytes, bytes]) -> None:
    """Secure by default: no token, no data and no admin reads; etcd wants a login; the
    nodes' S3 key reaches only the kvpool bucket."""
    key = next(iter(chunks))
    with pytest.raises(AuthenticationError), Client(SEEDS, token="") as anonymous:
        anonymous.get(key)
    with pytest.raises(AuthenticationError), Client(SEEDS, token="x" * 32) as stranger:
        stranger.get(key)
    for _, admin in NODES.values():
        with pytest.raises(urllib.error.HTTPError) as refused:
            http_json(f"http://127.0.0.1:{admin}/v1/stats", token="")
        assert refused.value.code == 401
    request = urllib.request.Request("http://127.0.0.1:2379/v3/kv/range",
                                     json.dumps({"key": "Lw=="}).encode())
    with pytest.raises(urllib.error.HTTPError) as etcd_refused:
        urllib.request.urlopen(request, timeout=5)
    assert b"user name is empty" in etcd_refused.value.read()
    node_key = compose("exec", "-T", "kvpool-1", "cat", "/secrets/aws-credentials")
    fields = dict(line.split(" = ") for line in node_key.splitlines() if " = " in line)
    s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:9000", region_name="us-east-1",
                      **fields)
    assert s3.list_objects_v2(Bucket="kvpool", MaxKeys=1)["KeyCount"] >= 0
    with pytest.raises(botocore.exceptions.ClientError):
        s3.create_bucket(Bucket="not-kvpool")
    with client(SEEDS) as c:  # and the write token works
        assert c.get(key) == chunks[key]


def test_docker_stop_shuts_a_node_down_gracefully(chunks: dict[bytes, bytes]) -> None:
    service = "kvpool-1"
    ref = container(service)
    grace = 30  # stop_grace_period in docker-compose.yml
    run("docker", "stop", "-t", str(grace), ref, timeout=grace + 30)
    # exit code 0: it stopped on SIGTERM by itself (a SIGKILL after the grace is 137)
    assert inspect(ref, "{{.State.ExitCode}}") == "0"
    assert "kvpool: stopped" in run("docker", "logs", "--tail", "5", ref)
    with client([SEEDS[1], SEEDS[2]]) as c:
        assert c.get_many(list(chunks)) == list(chunks.values())
