"""Shared fixtures: real kvpool node processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvpool.client import Client
    from kvpool.client._node import NodeClient

#: the repository's root (engine drivers run from here as ``python -m tests.X``)
#: (the tests are not part of the installed package)
ROOT = Path(__file__).resolve().parent.parent

READY = re.compile(r"kvpool: ready data=(\S+):(\d+) admin=(\S+)")


@dataclass
class NodeProcess:
    proc: subprocess.Popen[str]
    host: str
    port: int
    admin_url: str
    data_dir: str
    output: list[str]

    @property
    def url(self) -> str:
        return f"kvpool://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode


def _drain(proc: subprocess.Popen[str], lines: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)


def start_node(*flags: str, data_dir: str | None = None, timeout: float = 30.0,
               env: dict[str, str] | None = None, own_group: bool = False) -> NodeProcess:
    """Run ``kvpool serve`` on free ports and wait for its ready line.

    The node's data dir is a fresh temp dir unless one is given (to restart a node on it).
    Its SSD tier gets 256 MiB unless the flags say otherwise. ``own_group``: the node and
    its children in a process group of their own, as a terminal runs them (a test can
    then send the group what Ctrl-C does).
    """
    data_dir = data_dir or tempfile.mkdtemp(prefix="kvpool-test-")
    cmd = [sys.executable, "-m", "kvpool.server", "serve", "--data-port", "0",
           "--admin-port", "0", "--log-level", "warning", "--data-dir", data_dir,
           "--ssd-capacity", "256MiB", *flags]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")},
           **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, process_group=0 if own_group else None)
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = READY.search(line)
        if m:
            # keep draining its output (a full pipe would block the node) for tests to read
            threading.Thread(target=_drain, args=(proc, lines), daemon=True).start()
            return NodeProcess(proc, m.group(1), int(m.group(2)), m.group(3), data_dir, lines)
    proc.kill()
    raise RuntimeError("node did not start:\n" + "".join(lines))


@pytest.fixture(scope="session", autouse=True)
def private_temp_dir(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every temp file of the run -- nodes' data dirs, token files, S3 servers' dirs, pytest's
    tmp_path, and whatever child processes make under $TMPDIR -- goes into one dir, removed
    at the end unless a test failed (then its path is printed, to look inside)."""
    path = tempfile.mkdtemp(prefix="kvpool-tests-")
    saved_env, saved_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = path
    try:
        yield path
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        if request.session.testsfailed:
            print(f"\nkvpool tests: temp files of this run kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3 server (moto's) on 127.0.0.1 for the whole session."""
    from moto.server import ThreadedMotoServer

    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh bucket on the session's S3 server."""
    import uuid

    import boto3

    name = f"kvpool-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(
        Bucket=name)
    return name


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    """One node per test module: 64 MiB DRAM tier."""
    n = start_node("--dram-capacity", "64MiB")
    yield n
    assert n.stop() == 0


@pytest.fixture
def small_node() -> Iterator[NodeProcess]:
    """A fresh DRAM-only node with a tiny DRAM tier, for eviction and capacity tests."""
    n = start_node("--dram-capacity", "1MiB", "--max-value", "512KiB", "--no-ssd")
    yield n
    n.stop()


def http_json(url: str, method: str = "GET", body: Any = None,
              token: str | None = None) -> tuple[int, Any]:
    """(status, decoded JSON) of one admin API call; HTTP errors are returned, not raised."""
    import json
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def send_frames(node: NodeProcess, frames: list[bytes], replies: int) -> None:
    """Send raw frames on a new connection and read ``replies`` reply frames (all OK)."""
    import socket

    from kvpool.protocol.frames import FrameHeader

    with socket.create_connection((node.host, node.port), timeout=5) as s:
        s.sendall(b"".join(frames))
        data, seen = b"", 0
        while seen < replies:
            data += s.recv(65536)
            while len(data) >= 24:
                header = FrameHeader.unpack(data[:24])
                if len(data) < 24 + header.body_len:
                    break
                assert header.status == 0
                data = data[24 + header.body_len:]
                seen += 1


def put_raw(node: NodeProcess, key: bytes, value: bytes) -> None:
    """HELLO, then one PUT of ``value`` exactly as given (not sealed by a client)."""
    from kvpool.protocol.frames import Op, PutItemHeader, encode_frame, encode_json

    send_frames(node, [*encode_frame(Op.HELLO, 1, [encode_json({"protocol": 1})]),
                       *encode_frame(Op.PUT, 2, [PutItemHeader(key, len(value)).pack(), value],
                                     count=1)], replies=2)


def put_corrupt(node: NodeProcess, key: bytes, payload: bytes, flip: int = 0) -> None:
    """Store ``payload`` under ``key`` with a valid envelope header but byte ``flip`` of the
    payload changed after sealing: the node accepts it, every reader must reject it."""
    from kvpool.protocol.envelope import seal

    body = bytearray(payload)
    envelope = seal(body)
    body[flip] ^= 0xFF
    put_raw(node, key, envelope + bytes(body))


def text_prompt(tokenizer: Any, n: int, topic: str) -> list[int]:
    """``n`` token ids of English text about ``topic`` (different topics share no prefix)."""
    text = " ".join(f"Note {i} on {topic}: engines recompute attention keys and values for "
                    f"prefixes they have already seen, and a shared cache avoids it."
                    for i in range(n // 10))
    ids: list[int] = tokenizer(text).input_ids
    assert len(ids) >= n
    return ids[:n]


class NoLoop:
    """Stands in for a sync client's event loop (``client._free.loop = NoLoop(client._free.loop)``)
    and fails the test if it is run: the calls made meanwhile took a loop-free path."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop

    def is_closed(self) -> bool:
        return bool(self.loop.is_closed())

    def run_until_complete(self, coro: object) -> None:
        close = getattr(coro, "close", None)
        if close is not None:
            close()  # (never to run: no "never awaited" warning)
        raise AssertionError(f"the event loop ran for {coro}")


@contextlib.contextmanager
def no_loop(client: Any) -> Iterator[None]:
    """Within it, the sync ``client`` fails the test if it runs its event loop."""
    loop = client._free.loop
    client._free.loop = NoLoop(loop)
    try:
        yield
    finally:
        client._free.loop = loop


def node_stats(node: NodeProcess) -> dict[str, Any]:
    """``GET /v1/stats`` of ``node`` (which must answer 200)."""
    status, stats = http_json(f"{node.admin_url}/v1/stats")
    assert status == 200
    out: dict[str, Any] = stats
    return out


def shm_node(client: Client) -> NodeClient:
    """A sync client's standalone node, which granted it the shared-memory arena."""
    node = client.async_client._router.standalone_node
    assert node is not None and node.path.mapping is not None
    return node


def tokens_file(tokens: dict[str, tuple[str, str]], quotas: str = "") -> str:
    """A tokens file (``token -> (tenant, role)``, then ``quotas`` verbatim); its path."""
    fd, path = tempfile.mkstemp(prefix="kvpool-tokens-", suffix=".toml")
    with os.fdopen(fd, "w") as f:
        for token, (tenant, role) in tokens.items():
            f.write(f'[[token]]\ntoken = "{token}"\ntenant = "{tenant}"\nrole = "{role}"\n\n')
        f.write(quotas)
    return path
