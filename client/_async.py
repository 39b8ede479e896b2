"""The async SDK core. The sync :class:`kvpool.client.Client` is a facade over this."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, cast
from urllib.parse import urlsplit

from kvpool.client._connection import Buffer, Connection
from kvpool.placement.keys import key_from_hex
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE, ZERO_FINGERPRINT, seal
from kvpool.protocol.errors import (
    BufferTooSmallError,
    CapacityError,
    ConfigError,
    InvalidKeyError,
    KvpoolConnectionError,
    KvpoolTimeoutError,
    NotDurableError,
    Status,
    ValueTooLargeError,
    error_for_status,
)
from kvpool.protocol.frames import (
    KEY_SIZE,
    PROTOCOL_VERSION,
    PUT_FLAG_PIN,
    Op,
    PutItemHeader,
    Tier,
    decode_json,
    decode_lookup,
    decode_statuses,
    encode_json,
)
from kvpool.protocol.parsers import TOO_SMALL, Reply

__all__ = ["AsyncClient", "Key", "parse_url"]

log = logging.getLogger("kvpool.client")

Key = bytes | str
DEFAULT_PORT = 7700
_TIER_NAMES = {int(t): t.name.lower() for t in Tier}


def parse_url(url: str) -> tuple[str, int]:
    """``kvpool://host:port`` (or ``host:port``) -> (host, port)."""
    parts = urlsplit(url if "://" in url else f"kvpool://{url}")
    if parts.scheme != "kvpool":
        raise ConfigError(f"node URL must start with kvpool://, got {url!r}")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ConfigError(f"bad port in node URL {url!r}") from None
    if not parts.hostname:
        raise ConfigError(f"no host in node URL {url!r}")
    return parts.hostname, port


def _key(key: Key) -> bytes:
    if isinstance(key, str):
        return key_from_hex(key)
    if not isinstance(key, bytes | bytearray | memoryview):
        raise InvalidKeyError(f"a key is bytes or a hex str, got {type(key).__name__}")
    if len(key) != KEY_SIZE:
        raise InvalidKeyError(f"a key is {KEY_SIZE} bytes, got {len(key)}")
    return bytes(key)


def _join_keys(keys: Sequence[Key]) -> bytes:
    """All keys as one validated 16*n byte blob: the body of a key-list frame."""
    try:
        blob = b"".join(keys)  # type: ignore[arg-type]  # fast path: all bytes-like
    except TypeError:
        return b"".join([_key(k) for k in keys])
    if len(blob) != KEY_SIZE * len(keys) or any(n != KEY_SIZE for n in map(len, keys)):
        return b"".join([_key(k) for k in keys])  # raises InvalidKeyError for the bad one
    return blob


def _ttl_ms(ttl: float | None) -> int:
    if ttl is None:
        return 0
    if ttl <= 0:
        raise ValueError("ttl must be > 0 seconds (or None for the node default)")
    return max(1, min(int(ttl * 1000), 0xFFFFFFFF))


def _chunks(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(n, start + size))


def _blob_part(blob: bytes, part: range) -> bytes:
    return blob[part.start * KEY_SIZE : part.stop * KEY_SIZE]


class AsyncClient:
    """Async client of one kvpool node.

    Values are stored inside a checksummed envelope; every read is verified
    as it arrives. A value that fails verification is treated as a **miss**
    (``get`` returns None), counted in :attr:`num_corrupt`, and deleted from
    the node so the next writer replaces it.
    """

    def __init__(self, url: str = f"kvpool://127.0.0.1:{DEFAULT_PORT}", *, pool_size: int = 2,
                 timeout: float = 10.0, connect_timeout: float = 5.0,
                 client_name: str = "kvpool-python") -> None:
        if pool_size < 1:
            raise ConfigError("pool_size must be >= 1")
        if timeout <= 0 or connect_timeout <= 0:
            raise ConfigError("timeouts must be > 0 seconds")
        self.host, self.port = parse_url(url)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.client_name = client_name
        self._slots: list[Connection | None] = [None] * pool_size
        self._connecting: dict[int, asyncio.Future[Connection]] = {}
        self._next_slot = 0
        self.server_info: dict[str, Any] = {}
        self.num_corrupt = 0

    # -- lifecycle ------------------------------------------------------------------------

    async def connect(self) -> None:
        """Open the first connection now (otherwise the first call does)."""
        await self._connection()

    async def close(self) -> None:
        for i, conn in enumerate(self._slots):
            if conn is not None:
                conn.close()
            self._slots[i] = None

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- single-key API -------------------------------------------------------------------

    async def put(self, key: Key, value: Buffer, *, ttl: float | None = None, pin: bool = False,
                  chunk_index: int = 0, num_tokens: int = 0,
                  fingerprint: bytes = ZERO_FINGERPRINT) -> None:
        """Store ``value``. Raises CapacityError if the node has no room even after eviction."""
        await self.put_many([key], [value], ttl=ttl, pin=pin, chunk_indexes=[chunk_index],
                            num_tokens=num_tokens, fingerprint=fingerprint)

    async def get(self, key: Key) -> bytearray | None:
        """The payload as a new bytearray, or None on a miss (or a corrupt chunk)."""
        return (await self.get_many([key]))[0]

    async def get_into(self, key: Key, buffer: Buffer) -> int | None:
        """Receive the payload straight into ``buffer``; its length, or None on a miss."""
        return (await self.get_many_into([key], [buffer]))[0]

    async def exists(self, key: Key) -> bool:
        return (await self.exists_many([key]))[0]

    async def delete(self, key: Key) -> bool:
        """True if the key was present."""
        return (await self.delete_many([key]))[0]

    async def pin(self, key: Key) -> bool:
        """Never evict this chunk (TTL still applies); False if absent. Idempotent."""
        return (await self._statuses(Op.PIN, _key(key)))[0] == Status.OK

    async def unpin(self, key: Key) -> bool:
        return (await self._statuses(Op.UNPIN, _key(key)))[0] == Status.OK

    # -- batch API ------------------------------------------------------------------------

    async def put_many(self, keys: Sequence[Key], values: Sequence[Buffer], *,
                       ttl: float | None = None, pin: bool = False,
                       chunk_indexes: Sequence[int] | None = None, num_tokens: int = 0,
                       fingerprint: bytes = ZERO_FINGERPRINT) -> None:
        """Store several values in as few frames as the node's limits allow.

        ``chunk_indexes`` (default 0) is each chunk's depth in its prefix; the
        node evicts deeper chunks first at equal recency. Raises CapacityError
        naming the keys that did not fit (the others are stored).
        """
        if len(keys) != len(values):
            raise ValueError("put_many needs as many values as keys")
        if chunk_indexes is not None and len(chunk_indexes) != len(keys):
            raise ValueError("put_many needs one chunk index per key")
        bkeys = [_key(k) for k in keys]
        ttl_ms = _ttl_ms(ttl)
        flags = PUT_FLAG_PIN if pin else 0
        conn = await self._connection()
        max_value = int(self.server_info["max_value_bytes"])
        max_frame = int(self.server_info["max_frame_bytes"])
        max_batch = int(self.server_info["max_batch"])
        frames: list[tuple[list[bytes], list[Buffer]]] = []
        frame_keys: list[bytes] = []
        body: list[Buffer] = []
        frame_bytes = 0
        for i, (key, value) in enumerate(zip(bkeys, values, strict=True)):
            payload = memoryview(value).cast("B")
            value_len = ENVELOPE_HEADER_SIZE + payload.nbytes
            if value_len > max_value:
                raise ValueTooLargeError(
                    f"value of {payload.nbytes} bytes (+{ENVELOPE_HEADER_SIZE} envelope) exceeds "
                    f"the node's max_value_bytes {max_value}")
            item_bytes = 32 + value_len
            if frame_keys and (len(frame_keys) == max_batch
                               or frame_bytes + item_bytes > max_frame):
                frames.append((frame_keys, body))
                frame_keys, body, frame_bytes = [], [], 0
            envelope = seal(payload, chunk_index=chunk_indexes[i] if chunk_indexes else 0,
                            num_tokens=num_tokens, fingerprint=fingerprint)
            body += [PutItemHeader(key, value_len, ttl_ms, flags).pack(), envelope, payload]
            frame_keys.append(key)
            frame_bytes += item_bytes
        if frame_keys:
            frames.append((frame_keys, body))
        replies = await self._gather([(conn, Op.PUT, len(k), b, None) for k, b in frames])
        failed: list[bytes] = []
        not_durable: list[bytes] = []
        for (fkeys, _), reply in zip(frames, replies, strict=True):
            for key, status in zip(fkeys, decode_statuses(reply.body, len(fkeys)), strict=True):
                if status == Status.NO_CAPACITY:
                    failed.append(key)
                elif status == Status.UNAVAILABLE:
                    not_durable.append(key)
                elif status != Status.OK:
                    raise error_for_status(status, f"PUT of {key.hex()} refused")
        if not_durable:
            raise NotDurableError(
                f"{len(not_durable)} of {len(bkeys)} values are cached but not in S3 (the node "
                f"runs write-through): {', '.join(k.hex() for k in not_durable[:4])}")
        if failed:
            raise CapacityError(f"node had no room for {len(failed)} of {len(bkeys)} values "
                                "(everything left is pinned or being read)", failed)

    async def get_many(self, keys: Sequence[Key]) -> list[bytearray | None]:
        """Payloads as new bytearrays (None for misses), in key order."""
        results = await self._get(keys, None)
        # with no caller sinks the parser receives each payload into a bytearray of its own
        return [cast(bytearray, r.obj) if r is not None else None for r in results]

    async def get_many_into(self, keys: Sequence[Key], buffers: Sequence[Buffer]
                            ) -> list[int | None]:
        """Receive each payload into its buffer; lengths, None for misses."""
        if len(keys) != len(buffers):
            raise ValueError("get_many_into needs one buffer per key")
        sinks = []
        for b in buffers:
            view = memoryview(b)
            if view.readonly:
                raise ValueError("get_into needs a writable buffer")
            sinks.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
        results = await self._get(keys, sinks)
        return [len(r) if r is not None else None for r in results]

    async def exists_many(self, keys: Sequence[Key]) -> list[bool]:
        return [code != 0 for code in await self._exists(keys)]

    async def exists_tiers(self, keys: Sequence[Key]) -> list[str | None]:
        """The tier ("dram", "ssd", "s3") holding each key, None where none does."""
        return [_TIER_NAMES.get(code, "?") if code else None for code in await self._exists(keys)]

    async def _exists(self, keys: Sequence[Key]) -> bytes:
        """One tier code per key, 0 where absent (the EXISTS reply's second half)."""
        blob = _join_keys(keys)
        conn = await self._connection()
        parts = list(_chunks(len(keys), int(self.server_info["max_batch"])))
        replies = await self._gather(
            [(conn, Op.EXISTS, len(p), [_blob_part(blob, p)], None) for p in parts])
        codes = bytearray()
        for part, reply in zip(parts, replies, strict=True):
            body = reply.body  # count statuses, then count tier codes
            if len(body) != 2 * len(part):
                raise error_for_status(Status.BAD_FRAME, "EXISTS reply of the wrong size")
            codes += body[len(part) :]
        return bytes(codes)

    async def delete_many(self, keys: Sequence[Key]) -> list[bool]:
        statuses = await self._statuses(Op.DELETE, _join_keys(keys))
        return [s == Status.OK for s in statuses]

    async def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` (a prefix's chunk keys, in order) the node holds."""
        return len(await self.lookup_tiers(keys))

    async def lookup_tiers(self, keys: Sequence[Key]) -> list[str]:
        """The tier ("dram", "ssd" or "s3") of each leading key the node holds, in order."""
        blob = _join_keys(keys)
        conn = await self._connection()
        max_batch = int(self.server_info["max_batch"])
        tiers: list[str] = []
        for part in _chunks(len(keys), max_batch):
            reply = await self._call(conn, Op.LOOKUP, len(part), [_blob_part(blob, part)])
            found = decode_lookup(reply.body)
            tiers += [_TIER_NAMES.get(t, "?") for t in found]
            if len(found) < len(part):
                break
        return tiers

    async def stats(self) -> dict[str, Any]:
        conn = await self._connection()
        return decode_json((await self._call(conn, Op.STATS, 0, [])).body)

    # -- internals ------------------------------------------------------------------------

    async def _get(self, keys: Sequence[Key], sinks: Sequence[memoryview] | None
                   ) -> list[memoryview | None]:
        blob = _join_keys(keys)
        conn = await self._connection()
        max_batch = int(self.server_info["max_batch"])
        parts = list(_chunks(len(keys), max_batch))
        calls = [(conn, Op.GET, len(p), [_blob_part(blob, p)],
                  [sinks[i] for i in p] if sinks is not None else None) for p in parts]
        replies = await self._gather(calls)
        out: list[memoryview | None] = []
        corrupt: list[bytes] = []
        for part, reply in zip(parts, replies, strict=True):
            for i, item in zip(part, reply.items, strict=True):
                if item.status == Status.OK:
                    out.append(item.payload)
                    continue
                if item.status == TOO_SMALL:
                    assert item.envelope is not None
                    raise BufferTooSmallError(
                        f"buffer of {len(sinks[i]) if sinks else 0} bytes is too small for the "
                        f"{item.envelope.stored_len}-byte payload of "
                        f"{_blob_part(blob, range(i, i + 1)).hex()}")
                if item.status == Status.CORRUPT:
                    corrupt.append(_blob_part(blob, range(i, i + 1)))
                out.append(None)
        if corrupt:
            self.num_corrupt += len(corrupt)
            log.warning("dropping %d corrupt chunk(s) (treated as misses): %s", len(corrupt),
                        ", ".join(k.hex() for k in corrupt[:4]))
            await self.delete_many(corrupt)
        return out

    async def _statuses(self, op: Op, blob: bytes) -> list[int]:
        conn = await self._connection()
        count = len(blob) // KEY_SIZE
        parts = list(_chunks(count, int(self.server_info["max_batch"])))
        replies = await self._gather(
            [(conn, op, len(p), [_blob_part(blob, p)], None) for p in parts])
        statuses: list[int] = []
        for part, reply in zip(parts, replies, strict=True):
            statuses += decode_statuses(reply.body, len(part))
        return statuses

    async def _gather(self, calls: Sequence[tuple[Connection, int, int, Sequence[Buffer],
                                                  Sequence[memoryview | None] | None]]
                      ) -> list[Reply]:
        if len(calls) == 1:
            return [await self._call(*calls[0])]
        return list(await asyncio.gather(*(self._call(*c) for c in calls)))

    async def _call(self, conn: Connection, op: int, count: int, body: Sequence[Buffer],
                    sinks: Sequence[memoryview | None] | None = None) -> Reply:
        reply = await conn.send(op, count, body, sinks)  # the connection enforces the deadline
        status = reply.header.status
        if status != Status.OK:
            raise error_for_status(status, bytes(reply.body).decode("utf-8", "replace"))
        return reply

    async def _connection(self) -> Connection:
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self._slots)
        conn = self._slots[slot]
        if conn is not None and conn.is_open:
            return conn
        connecting = self._connecting.get(slot)
        if connecting is None:
            connecting = asyncio.ensure_future(self._open())
            self._connecting[slot] = connecting
            try:
                conn = await connecting
                self._slots[slot] = conn
            finally:
                del self._connecting[slot]
            return conn
        return await asyncio.shield(connecting)

    async def _open(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(self.timeout, f"{self.host}:{self.port}"),
                    self.host, self.port)
        except TimeoutError:
            raise KvpoolTimeoutError(
                f"connecting to {self.host}:{self.port} took longer than {self.connect_timeout}s"
            ) from None
        except OSError as exc:
            raise KvpoolConnectionError(
                f"cannot connect to kvpool node {self.host}:{self.port}: {exc}") from exc
        hello = encode_json({"protocol": PROTOCOL_VERSION, "client": self.client_name})
        try:
            reply = await self._call(conn, Op.HELLO, 0, [hello])
        except BaseException:
            conn.close()
            raise
        self.server_info = decode_json(reply.body)
        return conn
