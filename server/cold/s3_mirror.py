"""The node's copy of which keys S3 holds, kept from the SSD worker's log of S3 changes.

The worker owns S3 (its uploads, its LISTs of what other nodes wrote) and logs each
change it learns of; the node reads the log from where it stopped (``SsdTier`` polls
it) and answers "is it in S3?" from this set without I/O. A DELETE the node sent is
a race with the log: until the worker logs that DELETE, an older PRESENT record of
the same key is stale, so pending DELETEs are counted here.
"""

from __future__ import annotations

from kvpool.protocol.worker import S3_CHANGE, S3Change

__all__ = ["S3KeyMirror"]


class S3KeyMirror:
    """Keys S3 holds as far as the worker has said, and the log position read up to."""

    __slots__ = ("_deleting", "_keys", "log_pos")

    def __init__(self) -> None:
        self._keys: set[bytes] = set()
        #: records of the worker's log applied so far
        self.log_pos = 0
        #: keys with DELETEs sent whose record the worker has not logged yet: how many
        self._deleting: dict[bytes, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: bytes) -> None:
        """The node saw S3 take ``key`` (a durable write, a fetch)."""
        self._keys.add(key)

    def discard(self, key: bytes) -> None:
        """The node saw S3 miss ``key``."""
        self._keys.discard(key)

    def deleting(self, key: bytes) -> None:
        """A DELETE of ``key`` went to the worker, which will log one DELETED record."""
        self._keys.discard(key)
        self._deleting[key] = self._deleting.get(key, 0) + 1

    def apply(self, records: bytes) -> int:
        """Apply S3_CHANGE ``records`` (the log's next ones); how many there were."""
        deleting, keys = self._deleting, self._keys
        for key, change in S3_CHANGE.iter_unpack(records):
            if change == S3Change.DELETED:
                left = deleting.pop(key, 1) - 1
                if left > 0:
                    deleting[key] = left
                keys.discard(key)
            elif change == S3Change.GONE:
                keys.discard(key)
            elif key not in deleting:  # else: from before a delete still under way
                keys.add(key)
        count = len(records) // S3_CHANGE.size
        self.log_pos += count
        return count
