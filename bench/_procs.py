"""Start and stop the processes a benchmark measures, all on 127.0.0.1."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = ["Proc", "free_port", "start_iperf3", "start_node", "start_redis"]

_READY = re.compile(r"kvpool: ready data=(\S+):(\d+) admin=(\S+)")


@dataclass
class Proc:
    proc: subprocess.Popen[str]
    port: int
    url: str = ""
    admin_url: str = ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


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


def start_node(*flags: str) -> Proc:
    """A node with its data dir in a fresh temp dir (left for the OS to clean)."""
    data_dir = tempfile.mkdtemp(prefix="kvpool-bench-")
    cmd = [sys.executable, "-m", "kvpool.server", "serve", "--data-port", "0", "--admin-port",
           "0", "--log-level", "warning", "--data-dir", data_dir, *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = _READY.search(line)
        if m:
            # keep reading its output: a full pipe would block the node mid-benchmark
            threading.Thread(target=lambda: [None for _ in proc.stdout or ()],
                             daemon=True).start()
            return Proc(proc, int(m.group(2)), f"kvpool://127.0.0.1:{m.group(2)}", m.group(3))
        if not line and proc.poll() is not None:
            break
    proc.kill()
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


def start_iperf3() -> Proc | None:
    exe = shutil.which("iperf3")
    if exe is None:
        return None
    port = free_port()
    proc = subprocess.Popen([exe, "-s", "-B", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    _wait_port(port, proc)
    return Proc(proc, port)
