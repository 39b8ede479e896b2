"""Node processes on this host: ``kvpool cluster up``, ``kvpool serve --nodes N``, the
tests and the benchmarks use it.

Each node is a ``kvpool serve`` process with its own ports and data dir,
all reading one static cluster file (``<data_dir>/cluster.toml``) written
before they start (or registering in etcd). Nodes can be killed (SIGKILL) and restarted on the same
ports and data dir, which is what the failover tests do.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kvpool.placement.cluster_map import MAX_COPIES, ClusterMap, NodeInfo
from kvpool.protocol.errors import ConfigError

__all__ = ["LocalCluster", "LocalEtcd", "LocalNode", "busy_ports", "free_ports"]

READY = re.compile(r"kvpool: ready data=(\S+):(\d+) admin=(\S+)")


def busy_ports(ports: Sequence[int], host: str = "127.0.0.1") -> list[int]:
    """Those of ``ports`` that something holds now (cannot be bound)."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive ports free now, below the kernel's ephemeral
    range (where it picks the local ports of outgoing connections and of port 0, so a
    run there can be taken between this check and the bind); a small race remains."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, max(low - count, 10001))
        if not busy_ports(range(base, base + count), host):
            return base
    raise ConfigError(f"no {count} consecutive free ports below {low} on {host}")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports the kernel says are free now (a small race remains until a node binds them)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class LocalNode:
    node_id: str
    data_port: int
    admin_port: int
    data_dir: Path
    #: the failure-domain label given to the node (--host-id; "" = the node's default)
    host_id: str = ""
    #: the address clients reach it by (its map entry's)
    advertise: str = "127.0.0.1"
    proc: subprocess.Popen[str] | None = None
    output: list[str] = field(default_factory=list)
    #: set by the output reader once the node printed its ready line
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def seed(self) -> str:
        return f"{self.advertise}:{self.data_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.advertise}:{self.admin_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_reason(self) -> str:
        """How the process ended: 'exit code N' or 'signal SIGKILL'."""
        code = self.proc.returncode if self.proc is not None else None
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit code {code}"

    def last_output(self, lines: int = 10) -> str:
        tail = "".join(self.output[-lines:]).rstrip()
        return tail or "(it printed nothing)"


class LocalEtcd:
    """A single-member etcd server (the ``etcd`` binary, e.g. Debian's etcd-server 3.4)
    on free 127.0.0.1 ports with its own data dir."""

    def __init__(self, data_dir: str | Path, binary: str = "etcd") -> None:
        self.data_dir = Path(data_dir)
        self.binary = binary
        self.client_port, self.peer_port = free_ports(2)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 30.0) -> None:
        import shutil
        import urllib.request

        if shutil.which(self.binary) is None:
            raise ConfigError(f"no {self.binary!r} on PATH (Debian: apt-get install etcd-server)")
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [self.binary, "--name", "kvpool", "--data-dir", str(self.data_dir),
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvpool={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.endpoint + "/version", timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        self.stop()
        raise ConfigError(f"etcd did not start on {self.endpoint}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> LocalEtcd:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalCluster:
    """``nodes`` node processes sharing one static map. Use as a context manager.

    ``standalone=True`` runs a single node without a map (the baseline of
    the cluster benchmarks). With ``etcd`` (an endpoint URL) the nodes take
    their map from etcd instead of a file: they register and join by
    themselves, and :attr:`map` is only the map they started from.

    ``host_ids`` labels each node's host (``--host-id``, and its map entry);
    ``advertise`` is the address in the map and the seeds (the nodes bind
    127.0.0.1 unless ``serve_args`` say ``--host``); node ids are
    ``name_prefix`` + index; ``keep_env`` passes the ``KVPOOL_*`` environment
    on to the nodes (dropped by default, so a test's nodes are its own).
    """

    def __init__(self, nodes: int = 3, *, replication: int = 2, fallbacks: int = 1,
                 data_dir: str | Path, standalone: bool = False, etcd: str = "",
                 etcd_prefix: str = "/kvpool/local", lease_ttl_s: float = 5.0,
                 base_port: int = 0, serve_args: Sequence[str] = (), log_level: str = "warning",
                 startup_timeout: float = 60.0, host_ids: Sequence[str] = (),
                 advertise: str = "127.0.0.1", name_prefix: str = "n",
                 keep_env: bool = False) -> None:
        if nodes < 1:
            raise ConfigError("a cluster needs at least one node")
        if standalone and nodes != 1:
            raise ConfigError("only a single node can run standalone (without a map)")
        self.standalone = standalone
        self.etcd = etcd
        self.etcd_prefix = etcd_prefix
        self.lease_ttl_s = lease_ttl_s
        if not 1 <= replication <= (MAX_COPIES if etcd else nodes):  # etcd: other hosts too
            raise ConfigError(f"replication must be in 1..{nodes} (the nodes started here)")
        if host_ids and len(host_ids) != nodes:
            raise ConfigError(f"host_ids names {len(host_ids)} hosts for {nodes} nodes")
        self.data_dir = Path(data_dir)
        if self.data_dir.exists() and not self.data_dir.is_dir():
            raise ConfigError(f"--data-dir {self.data_dir} is a file: give a directory (it is "
                              "created when missing)")
        ports = free_ports(2 * nodes) if base_port == 0 else \
            list(range(base_port, base_port + 2 * nodes))
        self.advertise = advertise
        self.name_prefix = name_prefix
        self.keep_env = keep_env
        self.nodes = [LocalNode(f"{name_prefix}{i}", ports[2 * i], ports[2 * i + 1],
                                self.data_dir / f"n{i}", host_id=host_ids[i] if host_ids else "",
                                advertise=advertise)
                      for i in range(nodes)]
        self.map = ClusterMap(epoch=1, replication=replication, fallbacks=fallbacks, nodes=tuple(
            NodeInfo(id=n.node_id, data=n.seed, admin=f"{advertise}:{n.admin_port}",
                     host=n.host_id) for n in self.nodes))
        self.map_file = self.data_dir / "cluster.toml"
        self.serve_args = list(serve_args)
        self.log_level = log_level
        self.startup_timeout = startup_timeout

    @property
    def seeds(self) -> list[str]:
        return [n.seed for n in self.nodes]

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.write_map(self.map)
        for node in self.nodes:
            self._spawn(node)
        for node in self.nodes:
            self._wait_ready(node)
        if self.etcd:
            self.wait_converged()

    def wait_converged(self, timeout: float = 30.0) -> None:
        """With etcd: wait until every running node serves a map in which every running
        node is up (registrations reach the others through their watches)."""
        running = [n for n in self.nodes if n.running]
        want = {n.node_id for n in running}
        deadline = time.monotonic() + timeout
        while True:
            try:
                ups = []
                for node in running:
                    with urllib.request.urlopen(f"{node.admin_url}/v1/cluster",
                                                timeout=5) as reply:
                        cmap = json.load(reply)
                    ups.append({n["id"] for n in cmap["nodes"] if n["state"] == "up"})
                if all(want <= up for up in ups):
                    return
            except (OSError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise ConfigError(f"nodes {sorted(want)} did not all see each other up in "
                                  f"{timeout} s")
            time.sleep(0.05)

    def write_map(self, cmap: ClusterMap) -> None:
        """Write the static map; :meth:`reload` makes running nodes read it."""
        tmp = self.map_file.with_suffix(".tmp")
        tmp.write_text(cmap.to_toml())
        os.replace(tmp, self.map_file)
        self.map = cmap

    def reload(self) -> None:
        """SIGHUP every running node: they re-read the cluster file."""
        for node in self.nodes:
            if node.running:
                assert node.proc is not None
                node.proc.send_signal(signal.SIGHUP)

    def add_node(self) -> LocalNode:
        """Start one more node (with etcd it registers and joins by itself)."""
        data_port, admin_port = free_ports(2)
        node = LocalNode(f"{self.name_prefix}{len(self.nodes)}", data_port, admin_port,
                         self.data_dir / f"n{len(self.nodes)}", advertise=self.advertise)
        self.nodes.append(node)
        self._spawn(node)
        self._wait_ready(node)
        if self.etcd:
            self.wait_converged()
        return node

    def kill(self, index: int) -> None:
        """SIGKILL one node (no goodbye, as in a crash)."""
        proc = self.nodes[index].proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def restart(self, index: int) -> None:
        node = self.nodes[index]
        self.kill(index)
        self._spawn(node)
        self._wait_ready(node)

    def supervise(self, stop: threading.Event, *, restart: bool = True,
                  report: Callable[[str], None] = print, backoff_s: float = 1.0,
                  max_backoff_s: float = 30.0, stable_s: float = 60.0) -> None:
        """Until ``stop`` is set, watch the nodes: report each one that exits (how, and its
        last output) and, with ``restart``, start it again on its ports and data dir after
        a back-off that doubles on each failure (``backoff_s`` up to ``max_backoff_s``; back
        to ``backoff_s`` once a node has run for ``stable_s``). The other nodes keep
        serving meanwhile; a dead node stays in the map, so clients read from replicas."""
        delay = [backoff_s] * len(self.nodes)
        since = [time.monotonic()] * len(self.nodes)
        due: dict[int, float] = {}  # node index -> when to start it again
        down: set[int] = set()  # reported dead, not to be restarted
        returning: dict[int, int] = {}  # restarted, not ready yet -> restart count
        restarts = [0] * len(self.nodes)
        while not stop.wait(0.2):
            now = time.monotonic()
            for i, node in enumerate(self.nodes):
                if node.proc is None or i in down:
                    continue
                if node.running:
                    if i in returning and node.ready.is_set():
                        report(f"kvpool: node {node.node_id} is back (restart "
                               f"{returning.pop(i)}, pid {node.proc.pid})")
                    if now - since[i] > stable_s:
                        delay[i] = backoff_s
                    continue
                if i in due:
                    if now >= due[i] and not stop.is_set():
                        del due[i]
                        self._spawn(node)
                        since[i] = now
                        restarts[i] += 1
                        returning[i] = restarts[i]
                    continue
                returning.pop(i, None)
                report(f"kvpool: node {node.node_id} exited ({node.exit_reason()}); its last "
                       f"output:\n{node.last_output()}")
                if not restart:
                    down.add(i)
                    report(f"kvpool: {node.node_id} stays down (--no-restart); the other "
                           "nodes keep serving")
                    continue
                due[i] = now + delay[i]
                report(f"kvpool: restarting {node.node_id} in {delay[i]:g} s")
                delay[i] = min(delay[i] * 2, max_backoff_s)

    def stop(self, timeout: float = 10.0) -> list[int | None]:
        """SIGTERM every node, wait, SIGKILL stragglers; the exit codes."""
        for node in self.nodes:
            if node.running:
                assert node.proc is not None
                node.proc.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for node in self.nodes:
            if node.proc is None:
                codes.append(None)
                continue
            try:
                node.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(timeout)
            codes.append(node.proc.returncode)
        return codes

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- internals ------------------------------------------------------------------------

    def _spawn(self, node: LocalNode) -> None:
        node.data_dir.mkdir(parents=True, exist_ok=True)
        if self.standalone:
            cluster = []
        elif self.etcd:
            cluster = ["--etcd", self.etcd, "--etcd-prefix", self.etcd_prefix,
                       "--etcd-lease-ttl", str(self.lease_ttl_s),
                       "--replication", str(self.map.replication), "--node-id", node.node_id]
        else:
            cluster = ["--cluster-file", str(self.map_file), "--node-id", node.node_id]
        # serve_args may set the bind address and log level; what makes each node itself
        # (its ports, data dir, id, labels and map) comes after them, so it wins
        cmd = [sys.executable, "-m", "kvpool.server", "serve", "--host", "127.0.0.1",
               "--log-level", self.log_level, *self.serve_args, *cluster,
               "--data-port", str(node.data_port), "--admin-port", str(node.admin_port),
               "--data-dir", str(node.data_dir),
               *(["--host-id", node.host_id] if node.host_id else [])]
        env = dict(os.environ) if self.keep_env else \
            {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
        node.output = []
        node.ready = threading.Event()
        node.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        # read its output for as long as it runs (a full pipe would block the node)
        threading.Thread(target=_read_output, args=(node.proc, node.output, node.ready),
                         daemon=True).start()

    def _wait_ready(self, node: LocalNode) -> None:
        proc = node.proc
        assert proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while not node.ready.wait(0.05):
            if proc.poll() is not None:
                proc.wait()
                time.sleep(0.1)  # the reader's last lines
                raise ConfigError(f"node {node.node_id} exited before it was ready "
                                  f"({node.exit_reason()}); its last output:\n"
                                  + node.last_output())
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise ConfigError(f"node {node.node_id} was not ready within "
                                  f"{self.startup_timeout:g} s (a loaded machine? raise "
                                  "--startup-timeout); its last output:\n" + node.last_output())


def _read_output(proc: subprocess.Popen[str], lines: list[str], ready: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        del lines[:-200]  # the tail is what anyone reads
        if not ready.is_set() and READY.search(line):
            ready.set()
