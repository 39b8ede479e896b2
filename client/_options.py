"""A client's settings, declared and checked once: :class:`ClientOptions`."""

from __future__ import annotations

import ssl as ssl_module
from dataclasses import dataclass

from kvpool.client.transport import TcpTransport, Transport
from kvpool.protocol.errors import ConfigError
from kvpool.protocol.frames import SCOPE_FLAGS

__all__ = ["SHM_PUT_MIN_BYTES", "ClientOptions"]

#: a put call whose values total fewer bytes goes over TCP: through shared memory the
#: first put of a shape takes two round trips (PUT_SHM, COMMIT_AS; one for each put of
#: that shape after it, client/_shm_put.py), and the copy into the arena, which small
#: calls do not earn back. Measured on a 2-core VM (bench.throughput, shm / TCP): one
#: 256 KiB value 0.77x, one 1 MiB 1.01x, one 4 MiB 2.15x; 8 x 256 KiB 1.26x, 8 x 1 MiB
#: 1.90x (AMD, two round trips); with one round trip on an Intel VM (session 38, two
#: runs): one 256 KiB value 0.95-1.03x, one 1 MiB 0.90-0.93x, one 4 MiB 1.18-1.40x;
#: 8 x 256 KiB 0.87-0.89x, 8 x 1 MiB 1.57-1.60x
SHM_PUT_MIN_BYTES = 1 << 20

#: A sync call on a blocking socket polls for its reply this long before it sleeps. A
#: thread that sleeps for a reply is woken by the sender, and on a VM that wake-up is the
#: larger part of a small call: 4 KiB GETs over loopback on the 2-core VM, a raw socket
#: 0.101 ms p50 sleeping against 0.038 polling; the sync client 0.102 against 0.074-0.080
#: (20-200 us). A reply later than this is slept for as before, so a call spends at most
#: this much CPU more. 100 rather than 50 (session 45, ``python -m bench.client_ab``, one
#: node, as scheduled, 8 rounds): with the node on another CPU a reply often comes after
#: 50 us (the node's own wake-up), and the client then paid its wake-up too. Sync 4 KiB
#: get p50 0.73x, p99 0.157 against 0.192 ms, client CPU 0.071 against 0.086 ms a call;
#: lookup of 512 keys p50 0.725x (+13 us CPU). On 3 nodes sharing the 2 CPUs: p50 the
#: same, +20-40 us CPU a key op. All on one CPU longer polling only delays the node: p50
#: the same, p99 0.200 against 0.135 ms, +9 us CPU a get.
BUSY_POLL_US = 100.0


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How a client talks to every node it reaches (one set for the whole client).

    Built by :class:`kvpool.client.AsyncClient` from its keyword arguments (see
    its docstring for what each one does); ConfigError for a bad one, at
    construction rather than at connect.
    """

    #: pipelined connections per node
    pool_size: int = 2
    #: seconds a call may take before KvpoolTimeoutError (its connection is dropped)
    timeout: float = 10.0
    connect_timeout: float = 5.0
    #: the name HELLO gives the node (its logs and stats)
    client_name: str = "kvpool-python"
    #: the same-host fast path: None = where a node offers it, True = required, False = off
    shm: bool | None = None
    #: sent in HELLO to nodes that require one ("" = none)
    token: str = ""
    #: "tenant" (the token's own keys), "shared" or "raw"
    scope: str = "tenant"
    ssl: ssl_module.SSLContext | None = None
    #: put calls of at least this many bytes go through the arena, where a node allows
    shm_put_min_bytes: int = SHM_PUT_MIN_BYTES
    #: look values up in a node's arena index (no request) before asking GET_SHM
    shm_index: bool = True
    #: how connections reach nodes (None: TCP sockets; see :mod:`kvpool.client.transport`)
    transport: Transport | None = None
    #: microseconds the sync client's blocking sockets poll for a reply before they sleep
    #: (0: sleep at once); see :data:`BUSY_POLL_US`
    busy_poll_us: float = BUSY_POLL_US

    def __post_init__(self) -> None:
        if self.pool_size < 1:
            raise ConfigError("pool_size must be >= 1")
        if not (self.timeout > 0 and self.connect_timeout > 0):  # NaN fails this too
            raise ConfigError("timeouts must be > 0 seconds")
        if self.shm_put_min_bytes < 0:
            raise ConfigError("shm_put_min_bytes must be >= 0")
        if not 0 <= self.busy_poll_us <= 10_000:  # NaN fails this too
            raise ConfigError(f"busy_poll_us must be in [0, 10000], got {self.busy_poll_us!r}")
        if self.scope not in SCOPE_FLAGS:
            raise ConfigError(f"scope must be 'tenant', 'shared' or 'raw', got {self.scope!r}")

    @property
    def connector(self) -> Transport:
        """The transport connections are opened through."""
        return self.transport or _TCP

    @property
    def over_tcp(self) -> bool:
        """Whether connections are TCP sockets (the same-host fast path only makes sense
        then)."""
        return isinstance(self.connector, TcpTransport)

    @property
    def scope_flags(self) -> int:
        """The op-byte bits of :attr:`scope`, set on every key op and PUT."""
        return SCOPE_FLAGS[self.scope]


_TCP = TcpTransport()
