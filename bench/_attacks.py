"""Hostile clients that run beside the soak's load (``bench/soak.py``), each in a thread.

- :class:`UnauthenticatedPuts`: connections that never say HELLO, each sending one PUT
  header that announces a large value and no body; reconnecting whenever the node
  closes them (hostile-test break 1: such headers once made the node evict for them).
- :class:`MaximalLookups`: back-to-back admin lookups of the most tokens the node takes
  (break 5: one such lookup froze every GET on the node for seconds).
- :class:`TlsNonReaders`: TLS clients that ask for one large value many times over and
  never read (break 6: their replies were copied without bound).
- :class:`BadAdminBodies`: JSON nested 1,000 deep and bodies that announce more than a
  route takes, to the admin routes (round 3: a 500 with a traceback; must be 400 / 413).
- :class:`SilentSubscribers`: event streams that never read (round 3: they cut other
  clients' PUTs to 0.16x; now each is dropped once 10,000 events behind).
- :class:`AdminFlood`: idle connections to the admin port, as many as it holds (round 3:
  they took every descriptor and tenants' data connections were closed).

Every loop is bounded by ``stop`` (an Event) and its own pacing; all traffic goes to
127.0.0.1.
"""

from __future__ import annotations

import http.client
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

__all__ = ["AdminFlood", "BadAdminBodies", "MaximalLookups", "SilentSubscribers",
           "TlsNonReaders", "UnauthenticatedPuts"]

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


TCP_CLOSE_WAIT, TCP_CLOSE = 8, 7  # Linux's tcpi_state: the peer closed; reset


def _tcp_state(s: socket.socket) -> int:
    """The socket's TCP state (Linux TCP_INFO), read without reading its data."""
    try:
        return int(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0])
    except OSError:
        return TCP_CLOSE


def _admin_address(url: str) -> tuple[str, int]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return host, int(port)


class BadAdminBodies(threading.Thread):
    """Nested JSON and oversized bodies to the admin routes, in turn; counts the answers
    (a 5xx, or anything but a JSON error, is a failure of the node)."""

    NESTED = b"[" * 1000 + b"]" * 1000

    def __init__(self, admin_urls: list[str], stop: threading.Event, *,
                 pause_s: float = 0.2) -> None:
        super().__init__(daemon=True, name="attack-bad-admin-bodies")
        self.admin_urls, self.stop, self.pause_s = admin_urls, stop, pause_s
        self.answers: Counter[str] = Counter()

    def _send(self, url: str, path: str, body: bytes, length: int) -> str:
        host, port = _admin_address(url)
        head = (f"POST {path} HTTP/1.1\r\nHost: kvpool\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n")
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(head.encode() + body)
            reply = http.client.HTTPResponse(s)
            reply.begin()
            text = reply.read()
        try:
            json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"{reply.status}-not-json"
        return str(reply.status)

    def run(self) -> None:
        cases = [("/v1/lookup", self.NESTED, len(self.NESTED)),
                 ("/v1/admin/evict", self.NESTED, len(self.NESTED)),
                 ("/v1/cluster/join", self.NESTED, len(self.NESTED)),
                 ("/v1/lookup", b"{}", 70 << 20), ("/v1/admin/evict", b"{}", 100 << 10)]
        i = 0
        while not self.stop.is_set():
            url = self.admin_urls[i % len(self.admin_urls)]
            path, body, length = cases[i % len(cases)]
            i += 1
            try:
                self.answers[self._send(url, path, body, length)] += 1
            except OSError as exc:  # a node the soak killed
                self.answers[type(exc).__name__] += 1
            self.stop.wait(self.pause_s)

    def server_errors(self) -> int:
        return sum(n for code, n in self.answers.items()
                   if code.startswith("5") or code.endswith("not-json"))

    def summary(self) -> dict[str, object]:
        return {"answers": dict(self.answers), "server_errors": self.server_errors()}


class SilentSubscribers(threading.Thread):
    """``per_node`` event streams to each node that never read (small receive buffers);
    each one the node closes is opened again (unless ``reconnect`` is False)."""

    def __init__(self, admin_urls: list[str], stop: threading.Event, *,
                 per_node: int = 20, token: str = "", reconnect: bool = True) -> None:
        super().__init__(daemon=True, name="attack-silent-subscribers")
        self.admin_urls, self.stop, self.per_node = admin_urls, stop, per_node
        self.reconnect = reconnect
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self.request = f"GET /v1/events HTTP/1.1\r\nHost: kvpool\r\n{auth}\r\n".encode()
        self.opened = 0
        self.closed_by_node = 0

    def _open(self, url: str) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(5)
        s.connect(_admin_address(url))
        s.sendall(self.request)
        self.opened += 1
        return s

    def run(self) -> None:
        streams: list[tuple[str, socket.socket]] = []
        try:
            while not self.stop.is_set():
                for url, s in list(streams):  # closed by the node, without reading it
                    if _tcp_state(s) not in (TCP_CLOSE_WAIT, TCP_CLOSE):
                        continue
                    self.closed_by_node += 1
                    streams.remove((url, s))
                    s.close()
                for url in self.admin_urls:
                    while sum(u == url for u, _ in streams) < self.per_node and \
                            (self.reconnect or self.opened < self.per_node * len(self.admin_urls)):
                        try:
                            streams.append((url, self._open(url)))
                        except OSError:
                            break  # a node the soak killed
                self.stop.wait(1.0)
        finally:
            for _, s in streams:
                s.close()

    def summary(self) -> dict[str, int]:
        return {"streams_opened": self.opened, "closed_by_node": self.closed_by_node}


class AdminFlood(threading.Thread):
    """Keep ``per_node`` idle connections (never a byte sent) to each node's admin port,
    opening new ones as the node closes them (its cap, its idle timeout)."""

    def __init__(self, admin_urls: list[str], stop: threading.Event, *,
                 per_node: int = 400) -> None:
        super().__init__(daemon=True, name="attack-admin-flood")
        self.admin_urls, self.stop, self.per_node = admin_urls, stop, per_node
        self.opened = 0
        self.closed_by_node = 0
        #: set once the first pass has opened what it could
        self.ready = threading.Event()

    def run(self) -> None:
        idle: dict[str, list[socket.socket]] = {url: [] for url in self.admin_urls}
        try:
            while not self.stop.is_set():
                for url, held in idle.items():
                    for s in list(held):
                        if _tcp_state(s) not in (TCP_CLOSE_WAIT, TCP_CLOSE):
                            continue
                        self.closed_by_node += 1
                        held.remove(s)
                        s.close()
                    while len(held) < self.per_node and not self.stop.is_set():
                        try:
                            held.append(socket.create_connection(_admin_address(url),
                                                                 timeout=2))
                            self.opened += 1
                        except OSError:
                            break
                self.ready.set()
                self.stop.wait(1.0)
        finally:
            for held in idle.values():
                for s in held:
                    s.close()

    def summary(self) -> dict[str, int]:
        return {"connections_opened": self.opened, "closed_by_node": self.closed_by_node}
