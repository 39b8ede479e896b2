"""The SSD worker's log of what S3 holds, as the node reads it (``S3_KEYS``): one
``S3_CHANGE`` record (PRESENT, GONE, DELETED) a change, in the order the worker learned
of them; the node applies them to its mirror (``s3_mirror.py``) and asks from the first
record it has not applied, so the records before it are dropped."""

from __future__ import annotations

import threading

from kvpool.protocol.worker import S3_CHANGE, S3_LOG_PAGE, S3Change

__all__ = ["S3ChangeLog"]


class S3ChangeLog:
    """Thread-safe: S3 threads log, the request thread pages."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: the records from record number ``base`` on (those before it are applied)
        self.records: list[bytes] = []
        self.base = 0
        self._present: set[bytes] = set()  # keys whose last record says PRESENT

    def log(self, key: bytes, change: int) -> None:
        """Record a change of ``key``; a PRESENT already recorded or a GONE of a key never
        recorded present says nothing new, and is not logged."""
        with self._lock:
            if change == S3Change.PRESENT:
                if key in self._present:
                    return
                self._present.add(key)
            elif key in self._present:
                self._present.discard(key)
            elif change == S3Change.GONE:  # not logged as present: nothing to take back
                return
            self.records.append(S3_CHANGE.pack(key, change))

    def page(self, offset: int) -> bytes:
        """Up to ``S3_LOG_PAGE`` records from record number ``offset`` on (the first the
        node has not applied: the ones before it are dropped)."""
        with self._lock:
            done = min(max(0, offset - self.base), len(self.records))
            del self.records[:done]
            self.base += done
            start = max(0, offset - self.base)
            return b"".join(self.records[start : start + S3_LOG_PAGE])
