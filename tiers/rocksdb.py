"""SSD tier: chunks in a RocksDB database on local disk, through ``rocksdict``.

Why rocksdict: ``rocksdb-py`` was evaluated and lacks compression, block-cache
and column-family options, segfaults on an iterator after close, and ships no
aarch64 wheels.

Layout: the ``default`` column family maps key -> stored envelope (encoded by
this tier's codec, see tiers/codec.py); the ``meta`` column family maps key ->
``(stored_len, value_len, depth, written_at)``, written in the same WriteBatch, so that
opening the database rebuilds the index and eviction order without reading a
single value. RocksDB's own compression is off: values are compressed (or not)
by our codec, and the envelope checksum is verified on every read.

Eviction is least-recently-used (reads count; the order persisted across a
restart is the write order), deepest chunk first at equal recency, by the
*logical* bytes stored: RocksDB reclaims disk space later, in compaction.

This class blocks (disk I/O) and, as measured here, rocksdict holds the GIL
for tens to hundreds of milliseconds on a large ``put``: a node must not call
it from its event loop's process (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import rocksdict

from kvpool.protocol.envelope import Codec, EnvelopeHeader
from kvpool.protocol.errors import CorruptChunkError
from kvpool.tiers.base import TierStats
from kvpool.tiers.codec import decode, encode
from kvpool.tiers.ledger import Held, Ledger

__all__ = ["RocksDbTier"]

_META = struct.Struct("<QQIQ")  # stored_len, value_len (RAW envelope), depth, written_at (ms)
_META_CF = "meta"


def default_write_buffer(capacity_bytes: int) -> int:
    """Memtable size for a tier of ``capacity_bytes``: an eighth of it, 2-64 MiB.

    Up to four memtables fill before RocksDB stalls writes: with a fixed 64 MiB
    buffer a 16 MiB tier alone grew to 220-290 MiB of RSS (2 MiB: 82-91), and the
    soak's SSD workers (``bench/soak.py``) to 179-184 MiB, still rising.
    """
    return min(64 << 20, max(2 << 20, capacity_bytes // 8))


def _options(write_buffer_bytes: int, blob_files: bool = False) -> rocksdict.Options:
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    # values are 256 KiB-32 MiB and already compressed by our codec
    opts.set_compression_type(rocksdict.DBCompressionType.none())
    opts.set_write_buffer_size(write_buffer_bytes)
    opts.set_max_write_buffer_number(4)
    opts.set_target_file_size_base(256 << 20)
    opts.set_level_compaction_dynamic_level_bytes(True)
    opts.set_max_background_jobs(2)
    opts.set_keep_log_file_num(2)
    if blob_files:  # measured slower to read (docs/tiers.md); kept for the benchmark
        opts.set_enable_blob_files(True)
        opts.set_min_blob_size(0)
    return opts


def _out_of_space(exc: BaseException) -> bool:
    return "No space left on device" in str(exc)


class RocksDbTier:
    """get / put / delete / contains / stats over a RocksDB directory."""

    name = "ssd"

    def __init__(self, path: str | Path, capacity_bytes: int, *, codec: Codec = Codec.LZ4,
                 write_buffer_bytes: int | None = None, blob_files: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        if capacity_bytes <= 0:
            raise ValueError("SSD tier capacity must be > 0")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.codec = codec
        self._clock = clock
        if write_buffer_bytes is None:
            write_buffer_bytes = default_write_buffer(capacity_bytes)
        self._opts = _options(write_buffer_bytes, blob_files)
        # metadata rows are 28 bytes each: a small memtable holds thousands of them
        self._meta_opts = _options(min(write_buffer_bytes, 2 << 20))
        #: why the tier stopped admitting writes (the disk filled up), or None
        self.full: str | None = None
        #: keys deleted while the disk was full: deleted for real once writes work again
        self._unwritten_deletes: set[bytes] = set()
        try:
            self._open(read_only=False)
        except Exception as exc:  # rocksdict raises plain Exception for RocksDB IO errors
            if not _out_of_space(exc):
                raise
            # opening read-write replays the log into new files: with no space, serve what
            # is there read-only until reopen() succeeds
            self._open(read_only=True)
            self.full = f"opened read-only: {exc}"
        self._ledger: Ledger[Held] = Ledger()
        #: each key's RAW envelope length (what a DRAM slot for it needs)
        self._value_lens: dict[bytes, int] = {}
        #: keys evicted by the last ``put`` (the node drops them from its own index)
        self.last_evicted: list[bytes] = []
        self._stats = TierStats(self.name, capacity_bytes)
        self.num_corrupt = 0
        self._rebuild()

    def _open(self, *, read_only: bool) -> None:
        access = rocksdict.AccessType.read_only() if read_only \
            else rocksdict.AccessType.read_write()
        self._db = rocksdict.Rdict(str(self.path), self._opts, access_type=access,
                                   column_families={_META_CF: self._meta_opts})
        self._meta = self._db.get_column_family(_META_CF)
        self._meta_handle = self._db.get_column_family_handle(_META_CF)

    def reopen(self) -> bool:
        """After the disk filled up: try to take writes again (True once it does).

        RocksDB refuses every write after a write error until it is reopened, and a
        full disk at start-up opened it read-only. Deletes it refused meanwhile are
        made now, so a deleted chunk never comes back.
        """
        if self.full is None:
            return True
        self._close_db()
        try:
            self._open(read_only=False)
            batch = rocksdict.WriteBatch(raw_mode=True)
            for key in self._unwritten_deletes:
                batch.delete(key)
                batch.delete(key, self._meta_handle)
            self._db.write(batch)
        except Exception as exc:
            with contextlib.suppress(Exception):
                self._close_db()
            self._open(read_only=True)
            self.full = f"still no room: {exc}"
            self._reset_index()
            return False
        self.full = None
        self._unwritten_deletes.clear()
        self._reset_index()
        return True

    def _reset_index(self) -> None:
        """Rebuild the in-memory index from the metadata rows (keys deleted while full stay
        deleted)."""
        self._ledger = Ledger()
        self._value_lens.clear()
        self._rebuild()

    def _rebuild(self) -> None:
        rows: list[tuple[int, int, bytes, int]] = []
        for raw_key, raw in self._meta.items():
            key = cast(bytes, raw_key)  # raw mode: keys and values are bytes
            if key in self._unwritten_deletes:
                continue
            stored_len, value_len, depth, written_at = _META.unpack(cast(bytes, raw))
            self._value_lens[key] = value_len
            rows.append((written_at, -depth, key, stored_len))
        rows.sort()  # in the order they were written: the oldest first to evict
        for _, neg_depth, key, stored_len in rows:
            self._ledger.add(key, Held(stored_len, -neg_depth))

    # -- the Tier interface ---------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The RAW envelope, checksum verified; None on a miss or a corrupt value."""
        if key not in self._ledger:
            self._stats.misses += 1
            return None
        # the list form releases the GIL while RocksDB reads
        stored = cast(list[bytes | None], self._db.get([key]))[0]
        if stored is None:  # index and database disagree: trust the database
            self._forget(key)
            self._stats.misses += 1
            return None
        try:
            value = decode(stored)
        except CorruptChunkError:
            self.num_corrupt += 1
            self.delete(key)
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        self._ledger.touch(key)
        return value

    def put(self, key: bytes, value: bytes | bytearray | memoryview) -> bool:
        """Store a RAW envelope, encoded with this tier's codec; False if it cannot fit.

        After a write error (a full disk: RocksDB then refuses every write, even
        deletes, until it is reopened) the tier is ``full``: it serves reads and
        refuses writes.
        """
        if self.full is not None:
            self._stats.rejections += 1
            return False
        try:
            header = EnvelopeHeader.unpack(value)
        except CorruptChunkError:
            return False
        stored = encode(value, self.codec)
        size = len(stored)
        if size > self._stats.capacity_bytes:
            self._stats.rejections += 1
            return False
        self._forget(key)
        batch = rocksdict.WriteBatch(raw_mode=True)
        self.last_evicted = self._victims(size)
        for victim in self.last_evicted:
            batch.delete(victim)
            batch.delete(victim, self._meta_handle)
        batch.put(key, stored)
        written_at = int(self._clock() * 1000)
        batch.put(key, _META.pack(size, header.value_len, header.chunk_index, written_at),
                  self._meta_handle)
        try:
            self._db.write(batch)
        except Exception as exc:  # rocksdict raises plain Exception for RocksDB IO errors
            self.full = str(exc)
            self._stats.rejections += 1
            self._reset_index()  # the victims were not deleted after all
            return False
        self._ledger.add(key, Held(size, header.chunk_index))
        self._value_lens[key] = header.value_len
        self._stats.insertions += 1
        return True

    def delete(self, key: bytes) -> bool:
        if key not in self._ledger:
            return False
        batch = rocksdict.WriteBatch(raw_mode=True)
        batch.delete(key)
        batch.delete(key, self._meta_handle)
        self._forget(key)  # unreachable from now on, even if a full disk refuses the delete
        if self.full is not None:
            self._unwritten_deletes.add(key)
            return True
        try:
            self._db.write(batch)
        except Exception as exc:
            self.full = str(exc)
            self._unwritten_deletes.add(key)
        return True

    def contains(self, key: bytes) -> bool:
        return key in self._ledger

    def stats(self) -> TierStats:
        s = self._stats
        s.num_objects = len(self._ledger)
        s.used_bytes = s.allocated_bytes = self._ledger.used
        return TierStats(**s.to_dict())

    def value_lens(self) -> dict[bytes, int]:
        """Every key with the length of its RAW envelope (what a DRAM slot needs)."""
        return dict(self._value_lens)

    def close(self) -> None:
        self._close_db()

    def _close_db(self) -> None:
        # the column-family handles keep the database (and its LOCK) alive: drop them first
        del self._meta, self._meta_handle
        try:
            self._db.close()
        except Exception:
            if self.full is None:  # after a write error RocksDB reports it again on close
                raise

    # -- internals ------------------------------------------------------------------------

    def _victims(self, incoming: int) -> list[bytes]:
        """Keys to evict so ``incoming`` bytes fit; removed from the index now."""
        victims = self._ledger.victims(self._stats.capacity_bytes, incoming)
        for key in victims:
            del self._value_lens[key]
        self._stats.evictions += len(victims)
        return victims

    def _forget(self, key: bytes) -> None:
        if self._ledger.forget(key) is not None:
            del self._value_lens[key]
