"""What a node takes from its machine: DRAM and disk sizes, its ports, its data dir.

Each is resolved or taken once at start, with a one-line error (ConfigError) that
names the flag to change when the machine says no.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
from pathlib import Path

import psutil

from kvpool.protocol.envelope import CODEC_BY_NAME
from kvpool.protocol.errors import ConfigError
from kvpool.protocol.worker import S3Settings, TieringPolicy, WorkerSettings
from kvpool.server.cold.ssd import SsdTier
from kvpool.server.config import NodeConfig, format_size
from kvpool.server.memory import within_limit
from kvpool.tiers.dram import DramTier

__all__ = ["bind_error", "bound_socket", "dram_tier", "lock_data_dir",
           "memory_room", "resolve_dram_capacity", "resolve_ssd_capacity", "tiering_policy",
           "worker_settings"]


def memory_room() -> tuple[int, int]:
    """The memory this node may use in all, and what of it is free now: the machine's
    (``psutil``), within its container's cgroup limit where there is one."""
    machine = psutil.virtual_memory()
    return within_limit(machine.total, machine.available)


def resolve_dram_capacity(config: NodeConfig) -> int:
    """The configured capacity, or ``capacity_fraction`` of available memory; a capacity
    above the memory the node may use (the machine's, or its container's limit) is
    refused (the arena is allocated as it fills: the node would start, then be killed
    for memory long after)."""
    total, available = memory_room()
    if config.dram.capacity_bytes:
        if config.dram.capacity_bytes > total:
            raise ConfigError(
                f"--dram-capacity {format_size(config.dram.capacity_bytes)} is more than the "
                f"memory this node may use ({format_size(total)}, the machine's or its "
                f"container's limit): lower it, or leave it out for --dram-fraction "
                f"({config.dram.capacity_fraction:g}) of the memory available")
        return config.dram.capacity_bytes
    return int(available * config.dram.capacity_fraction)


def dram_tier(config: NodeConfig) -> DramTier:
    """The node's DRAM tier, its arena of the resolved capacity allocated (a ConfigError
    naming the flags when the machine refuses it)."""
    capacity = resolve_dram_capacity(config)
    try:
        return DramTier(capacity, default_ttl_s=config.dram.default_ttl_s or None,
                        allocate_ahead_bytes=config.dram.allocate_ahead_bytes,
                        policy=config.dram.policy)
    except (MemoryError, ValueError) as exc:
        raise ConfigError(f"DRAM tier of {format_size(capacity)}: {exc}; "
                          "lower --dram-capacity or --dram-fraction") from exc


def resolve_ssd_capacity(config: NodeConfig, path: Path) -> int:
    """The configured capacity, or ``capacity_fraction`` of the free space under ``path``."""
    if config.ssd.capacity_bytes:
        return config.ssd.capacity_bytes
    path.mkdir(parents=True, exist_ok=True)
    return int(shutil.disk_usage(path).free * config.ssd.capacity_fraction)


def tiering_policy(config: NodeConfig) -> TieringPolicy:
    """What lies below the node's DRAM, read from its config in this one place."""
    s3 = bool(config.s3.bucket)
    return TieringPolicy(ssd=config.ssd.enabled, s3=s3,
                         write_through=s3 and config.s3.write_through, admit=config.ssd.admit)


def worker_settings(config: NodeConfig, policy: TieringPolicy, path: Path) -> WorkerSettings:
    """What the cold-tier worker process is started with: the policy, the SSD's
    capacity (from the disk under ``path`` when given as a fraction), the codecs and the
    S3 tier's settings."""
    s3 = config.s3
    return WorkerSettings(
        capacity_bytes=resolve_ssd_capacity(config, path) if policy.ssd else 0,
        codec=CODEC_BY_NAME[config.ssd.codec],
        policy=policy,
        # the worker maps the arena writable: non-dumpable like the node
        no_dumps=bool(config.security.auth_tokens),
        s3=S3Settings(bucket=s3.bucket, prefix=s3.prefix, endpoint_url=s3.endpoint_url,
                      region=s3.region, codec=CODEC_BY_NAME[s3.codec],
                      max_pending_bytes=s3.max_pending_bytes,
                      relist_interval_s=s3.relist_interval_s) if policy.s3 else None)


def bound_socket(host: str, port: int, family: socket.AddressFamily) -> socket.socket:
    """Bound, not yet listening (the admin app listens once the node serves): until then a
    probe is refused at once rather than left waiting while the SSD tier loads."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def bind_error(exc: OSError, host: str, port: int, flag: str, env: str) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is in use (another kvpool node?): pick another with "
                f"{flag} or {env}")
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot bind {host}:{port}: {host} is not an address of this machine (--host)"
    if exc.errno == errno.EACCES:
        return f"cannot bind {host}:{port}: permission denied (ports below 1024 need root)"
    return f"cannot bind {host}:{port}: {exc.strerror or exc}"


def lock_data_dir(path: Path) -> int:
    """Take ``<path>/LOCK`` (flock) for this process's lifetime; ConfigError naming the
    holder when another node has it. The kernel drops the lock when the process dies."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--data-dir {path} is a file: give a directory (it is created "
                          "when missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot use --data-dir {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(f"another kvpool node (pid {holder}) is using --data-dir {path}: "
                          "stop it, or give this one another --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


async def start_cold(config: NodeConfig, dram: DramTier, policy: TieringPolicy
                     ) -> tuple[SsdTier, int | None]:
    """The cold tier's worker started (the SSD tier, S3 below it, or S3 alone, as
    ``policy`` says), and the flock on the data directory when the SSD tier is in it."""
    data_dir = Path(config.server.data_dir)
    lock = lock_data_dir(data_dir) if policy.ssd else None
    path = data_dir / "ssd"
    # chunks waiting for their write-behind cannot be evicted: keep them to a quarter of
    # DRAM so a PUT always finds room (the rest is shed and counted)
    pending = min(config.ssd.max_pending_bytes, dram.arena.capacity // 4)
    ssd = SsdTier(path, worker_settings(config, policy, path), arena_fd=dram.arena.fd,
                  arena_size=dram.arena.capacity, max_pending_bytes=pending,
                  full_retry_s=config.ssd.full_retry_s)
    try:
        await ssd.start()
    except BaseException:
        if lock is not None:
            os.close(lock)
        raise
    return ssd, lock


def advertised(address: tuple[str, int], advertise_host: str) -> tuple[str, int]:
    """The address peers and clients reach a socket bound to ``address`` by."""
    host = advertise_host or address[0]
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return host, address[1]
