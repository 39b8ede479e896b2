"""S3 tier: chunks as objects in a bucket shared by every node of a cluster.

Object names are ``<prefix>/<first 2 hex chars>/<32 hex chars of the key>``
(the 2-char fan-out spreads keys over S3's partitions). Values are envelopes
encoded with this tier's codec; the envelope's xxh3 checksum is verified on
every read, so boto3's own per-request CRC checksums are switched off
(``request_checksum_calculation="when_required"``): they cost 10-30% here and
would check the same bytes a second time.

Presence without a HEAD per key: the tier keeps an index of the keys it knows
to be in the bucket — those it wrote, and those a paged LIST found
(``load_index``, which a node runs in the background at start-up and then
every ``--s3-relist`` seconds: keys gone from the bucket -- another node
deleted them -- leave the index then). ``contains`` answers from the index alone; ``get`` goes
to S3 even for a key the index lacks (another node may have written it
since), so only a GET miss pays the round trip. ``listener``, if set, hears of
every change to the index that a ``delete`` call did not ask for: the worker
mirrors the index to its node through it.

Every call has a deadline (connect and read timeouts) and botocore's
"standard" retries with exponential back-off; an error is counted, logged at
most once per ``log_interval_s``, and reported as a miss or a refused write:
an unreachable S3 never raises into the caller and never blocks it for longer
than the deadline. The calls block: a node runs them off its event loop.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from kvpool.protocol.envelope import Codec, EnvelopeHeader
from kvpool.protocol.errors import CorruptChunkError
from kvpool.tiers.base import TierStats
from kvpool.tiers.codec import decode, encode
from kvpool.tiers.ledger import Held, Ledger

__all__ = ["S3Tier", "object_name"]

log = logging.getLogger("kvpool.tiers.s3")

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}


def object_name(prefix: str, key: bytes) -> str:
    hex_key = key.hex()
    return f"{prefix}/{hex_key[:2]}/{hex_key}" if prefix else f"{hex_key[:2]}/{hex_key}"


class S3Tier:
    """get / put / delete / contains / stats over one bucket and prefix."""

    name = "s3"

    def __init__(self, bucket: str, *, prefix: str = "kvpool", endpoint_url: str | None = None,
                 region: str | None = None, capacity_bytes: int = 0,
                 codec: Codec = Codec.RAW, elem_size: int = 2,
                 multipart_threshold: int = 16 << 20, connect_timeout_s: float = 2.0,
                 read_timeout_s: float = 10.0, max_attempts: int = 3,
                 log_interval_s: float = 30.0, client: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.codec = codec
        self.elem_size = elem_size
        config = Config(
            connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
            retries={"mode": "standard", "max_attempts": max_attempts},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=16)
        # credentials come from the standard AWS chain (env, profile, instance role)
        self._s3 = client or boto3.client("s3", endpoint_url=endpoint_url, region_name=region,
                                          config=config)
        self._transfer = TransferConfig(multipart_threshold=multipart_threshold,
                                        multipart_chunksize=max(5 << 20, multipart_threshold // 2),
                                        use_threads=False)
        self._lock = threading.Lock()  # the index is shared by the node's worker threads
        self._ledger: Ledger[Held] = Ledger()
        self._stats = TierStats(self.name, capacity_bytes)
        self._clock = clock
        self._log_interval = log_interval_s
        self._last_log = -1e18
        self.num_errors = 0
        self.num_corrupt = 0
        self.last_error: str | None = None
        #: called with (key, True) when the index gains a key, (key, False) when it drops one
        #: by itself (a 404, a corrupt object, a capacity victim, a LIST that lacks it); never
        #: for a ``delete`` call. Called with the index's lock held, so in the order of the
        #: changes: it must not call back into this tier.
        self.listener: Callable[[bytes, bool], None] | None = None
        #: while a LIST runs, the keys changed meanwhile (the LIST's view of them is stale)
        self._listing: set[bytes] | None = None

    # -- the Tier interface ---------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The RAW envelope, checksum verified; None on a miss, a corrupt value or an error."""
        try:
            response = self._s3.get_object(Bucket=self.bucket,
                                           Key=object_name(self.prefix, key))
            stored = response["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _NOT_FOUND:
                self._forget(key, notify=True)
            else:
                self._error("GET", exc)
            self._stats.misses += 1
            return None
        except BotoCoreError as exc:
            self._error("GET", exc)
            self._stats.misses += 1
            return None
        try:
            value = decode(stored)
        except CorruptChunkError:
            self.num_corrupt += 1
            self._forget(key, notify=True)
            self._delete_object(key)
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        with self._lock:
            if key not in self._ledger:
                self._remember(key, len(stored), EnvelopeHeader.unpack(value).chunk_index)
                self._notify(key, True)
            else:
                self._ledger.touch(key)
        return value

    def put(self, key: bytes, value: bytes | bytearray | memoryview) -> bool:
        """Upload a RAW envelope (multipart above the threshold); False if refused or failed."""
        try:
            header = EnvelopeHeader.unpack(value)
        except CorruptChunkError:
            return False
        stored = encode(value, self.codec, elem_size=self.elem_size)
        capacity = self._stats.capacity_bytes
        if capacity and len(stored) > capacity:
            self._stats.rejections += 1
            return False
        try:
            self._s3.upload_fileobj(io.BytesIO(stored), self.bucket,
                                    object_name(self.prefix, key), Config=self._transfer)
        except (BotoCoreError, ClientError) as exc:
            self._error("PUT", exc)
            self._stats.rejections += 1
            return False
        with self._lock:
            self._forget_locked(key)
            self._remember(key, len(stored), header.chunk_index)
            self._notify(key, True)
            victims = self._victims() if capacity else []
            for victim in victims:
                self._notify(victim, False)
        for victim in victims:
            self._delete_object(victim)
        self._stats.insertions += 1
        return True

    def delete(self, key: bytes) -> bool:
        with self._lock:
            known = key in self._ledger
            self._forget_locked(key)
        self._delete_object(key)
        return known

    def contains(self, key: bytes) -> bool:
        return key in self._ledger

    def confirm(self, key: bytes) -> bool | None:
        """Ask S3 (HEAD) whether it has ``key``: True, False (then the index forgets it) or
        None (S3 did not answer). For a claim that must not rest on the index alone."""
        try:
            self._s3.head_object(Bucket=self.bucket, Key=object_name(self.prefix, key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _NOT_FOUND:
                self._forget(key, notify=True)
                return False
            self._error("HEAD", exc)
            return None
        except BotoCoreError as exc:
            self._error("HEAD", exc)
            return None
        return True

    def keys(self) -> list[bytes]:
        with self._lock:
            return self._ledger.keys()

    def stats(self) -> TierStats:
        s = self._stats
        s.num_objects = len(self._ledger)
        s.used_bytes = s.allocated_bytes = self._ledger.used
        return TierStats(**s.to_dict())

    # -- index ----------------------------------------------------------------------------

    def load_index(self, page_size: int = 1000) -> int:
        """LIST the prefix (paged) and make the index match it; how many keys it added.

        Keys the LIST lacks leave the index. Keys this tier wrote, read or deleted while
        the LIST ran keep what those calls made of them: the LIST may predate them. A LIST
        that fails part way changes nothing.
        """
        paginator = self._s3.get_paginator("list_objects_v2")
        prefix = f"{self.prefix}/" if self.prefix else ""
        listed: dict[bytes, int] = {}
        with self._lock:
            self._listing = set()
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix,
                                           PaginationConfig={"PageSize": page_size}):
                for obj in page.get("Contents", ()):
                    try:
                        key = bytes.fromhex(obj["Key"].rsplit("/", 1)[-1])
                    except ValueError:
                        continue
                    if len(key) == 16:
                        listed[key] = int(obj["Size"])
        except (BotoCoreError, ClientError) as exc:
            self._error("LIST", exc)
            with self._lock:
                self._listing = None
            return 0
        found = 0
        with self._lock:
            changed, self._listing = self._listing, None
            for key in [k for k in self._ledger if k not in listed and k not in changed]:
                self._forget_locked(key)
                self._notify(key, False)
            for key, size in listed.items():
                if key not in self._ledger and key not in changed:
                    self._remember(key, size, 0)
                    self._notify(key, True)
                    found += 1
        return found

    # -- internals ------------------------------------------------------------------------

    def _notify(self, key: bytes, present: bool) -> None:
        if self.listener is not None:
            self.listener(key, present)

    def _remember(self, key: bytes, size: int, depth: int) -> None:
        if self._listing is not None:
            self._listing.add(key)
        self._ledger.add(key, Held(size, depth))

    def _forget(self, key: bytes, *, notify: bool = False) -> None:
        with self._lock:
            if self._forget_locked(key) and notify:
                self._notify(key, False)

    def _forget_locked(self, key: bytes) -> bool:
        """Drop ``key`` from the index; whether it was there."""
        if self._listing is not None:
            self._listing.add(key)
        return self._ledger.forget(key) is not None

    def _victims(self) -> list[bytes]:
        victims = self._ledger.victims(self._stats.capacity_bytes)
        if self._listing is not None:
            self._listing.update(victims)
        self._stats.evictions += len(victims)
        return victims

    def _delete_object(self, key: bytes) -> None:
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=object_name(self.prefix, key))
        except (BotoCoreError, ClientError) as exc:
            self._error("DELETE", exc)

    def _error(self, op: str, exc: Exception) -> None:
        self.num_errors += 1
        self.last_error = f"{op}: {exc}"
        now = self._clock()
        if now - self._last_log >= self._log_interval:
            self._last_log = now
            log.warning("S3 %s on bucket %s failed (%d errors so far): %s", op, self.bucket,
                        self.num_errors, exc)
