"""Hostile clients that run beside the soak's load (``bench/soak.py``), each in a thread.

- :class:`UnauthenticatedPuts`: connections that never say HELLO, each sending one PUT
  header that announces a large value and no body; reconnecting whenever the node
  closes them (hostile-test break 1: such headers once made the node evict for them).
- :class:`MaximalLookups`: back-to-back admin lookups of the most tokens the node takes
  (break 5: one such lookup froze every GET on the node for seconds).
- :class:`TlsNonReaders`: TLS clients that ask for one large value many times over and
  never read (break 6: their replies were copied without bound).

Every loop is bounded by ``stop`` (an Event) and its own pacing; all traffic goes to
127.0.0.1.
"""

from __future__ import annotations

import json
import random
import socket
import ssl
import struct
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

from kvpool.placement.lookup import MAX_LOOKUP_TOKENS

__all__ = ["MaximalLookups", "TlsNonReaders", "UnauthenticatedPuts"]

FRAME = struct.Struct("<2sBBIIIQ")  # magic, op, status, request id, count, epoch, body_len
PUT_ITEM = struct.Struct("<16sQII")
HELLO, PUT, GET = 1, 2, 3


class UnauthenticatedPuts(threading.Thread):
    """Keep ``connections`` silent connections to each address, each with a PUT header."""

    def __init__(self, addresses: list[tuple[str, int]], stop: threading.Event, *,
                 connections: int = 8, value_len: int = 12 << 20) -> None:
        super().__init__(daemon=True, name="attack-unauthenticated-puts")
        self.addresses, self.stop, self.connections = addresses, stop, connections
        self.header = (FRAME.pack(b"KV", PUT, 0, 1, 1, 0, PUT_ITEM.size + value_len)
                       + PUT_ITEM.pack(b"attack-unauthed!", value_len, 0, 0))
        self.opened = 0
        self.refused_at_once = 0  # closed by the node (error reply) as soon as it was sent

    def run(self) -> None:
        open_: list[socket.socket] = []
        try:
            while not self.stop.is_set():
                for s in list(open_):  # the node answers the frame with an error and closes
                    s.settimeout(0)
                    try:
                        if not s.recv(4096):
                            raise ConnectionError
                        self.refused_at_once += 1
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass
                    open_.remove(s)
                    s.close()
                while len(open_) < self.connections * len(self.addresses):
                    host, port = self.addresses[len(open_) % len(self.addresses)]
                    try:
                        s = socket.create_connection((host, port), timeout=2)
                        s.sendall(self.header)
                    except OSError:
                        break  # a node being killed by the soak: try again next round
                    open_.append(s)
                    self.opened += 1
                self.stop.wait(0.5)
        finally:
            for s in open_:
                s.close()

    def summary(self) -> dict[str, int]:
        return {"connections_opened": self.opened, "refused_at_once": self.refused_at_once}


class MaximalLookups(threading.Thread):
    """POST the largest lookup the node accepts, again and again, with a given token."""

    def __init__(self, admin_urls: list[str], stop: threading.Event, *,
                 token: str = "", pause_s: float = 0.5) -> None:
        super().__init__(daemon=True, name="attack-maximal-lookups")
        self.admin_urls, self.stop, self.token, self.pause_s = admin_urls, stop, token, pause_s
        rng = random.Random(7)
        ns = {"model": "attack", "dtype": "bf16", "num_layers": 2, "num_kv_heads": 2,
              "head_dim": 8, "chunk_tokens": 256}
        self.body = json.dumps({"namespace": ns, "tokens": [
            rng.randrange(1 << 17) for _ in range(MAX_LOOKUP_TOKENS)]}).encode()
        self.answers: Counter[str] = Counter()
        self.seconds: list[float] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            url = self.admin_urls[i % len(self.admin_urls)] + "/v1/lookup"
            i += 1
            headers = {"Content-Type": "application/json"}
            if self.token:
                headers["Authorization"] = f"Bearer {self.token}"
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(urllib.request.Request(
                        url, data=self.body, method="POST", headers=headers), timeout=60) as r:
                    self.answers[str(r.status)] += 1
            except urllib.error.HTTPError as exc:
                self.answers[str(exc.code)] += 1
            except OSError as exc:
                self.answers[type(exc).__name__] += 1
            self.seconds.append(time.perf_counter() - started)
            self.stop.wait(self.pause_s)

    def summary(self) -> dict[str, object]:
        done = sorted(self.seconds)
        return {"lookups": len(done), "body_mib": round(len(self.body) / (1 << 20), 1),
                "answers": dict(self.answers),
                "median_s": round(done[len(done) // 2], 2) if done else None}


class TlsNonReaders(threading.Thread):
    """``connections`` TLS clients, each asking for ``key`` 76 times and never reading;
    every ``hold_s`` they are closed and opened again."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext, key: bytes,
                 stop: threading.Event, *, connections: int = 8, hold_s: float = 20.0) -> None:
        super().__init__(daemon=True, name="attack-tls-non-readers")
        self.host, self.port, self.context, self.stop = host, port, context, stop
        self.connections, self.hold_s = connections, hold_s
        hello = json.dumps({"protocol": 1}).encode()
        self.frames = (FRAME.pack(b"KV", HELLO, 0, 1, 0, 0, len(hello)) + hello
                       + FRAME.pack(b"KV", GET, 0, 2, 64, 0, 16 * 64) + key * 64
                       + FRAME.pack(b"KV", GET, 0, 3, 12, 0, 16 * 12) + key * 12)
        self.opened = 0

    def run(self) -> None:
        while not self.stop.is_set():
            hogs: list[ssl.SSLSocket] = []
            try:
                for _ in range(self.connections):
                    raw = socket.create_connection((self.host, self.port), timeout=5)
                    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
                    s = self.context.wrap_socket(raw, server_hostname=self.host)
                    s.sendall(self.frames)
                    hogs.append(s)
                    self.opened += 1
            except OSError:
                pass
            self.stop.wait(self.hold_s)
            for s in hogs:
                s.close()

    def summary(self) -> dict[str, int]:
        return {"connections_opened": self.opened}
