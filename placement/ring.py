"""Consistent hashing with virtual nodes, weighted by capacity. Pure; numpy-vectorised.

A node of weight ``w`` owns ``max(1, round(w * vnodes_per_weight))`` points
on a 64-bit ring; point ``i`` of node ``id`` sits at
``xxh3_64(f"{id}#{i}")``. A key's position is the first 8 bytes of the chunk
key read big-endian (chunk keys are xxh3-128 digests, already uniform), and
its owners are the first ``r`` *distinct* nodes met walking clockwise from
there (the first point at or after the position, wrapping at 2**64).

The ring precomputes, for every point, the first ``width`` distinct nodes
clockwise from it, so placing a batch of keys is one ``searchsorted`` plus
one table lookup: 512 keys take a few tens of microseconds.

Why 2048 points per unit of weight: a node's share of the ring is a sum of
its arcs, whose relative spread is about ``1/sqrt(points)``. Measured over
40 random 8-node rings with 1M keys each, the most loaded node held at most
1.19x the mean at 256 points, 1.09x at 1024 and 1.05x at 2048 (the property
tests bound it at 1.10x). Points cost memory (8 bytes each plus ``4 *
width`` for the table: ~200 KiB per node at width 3) and build time
(~1 ms per node), not lookup time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from kvpool.protocol.errors import ConfigError, InvalidKeyError

__all__ = ["DEFAULT_VNODES_PER_WEIGHT", "Ring", "key_positions"]

DEFAULT_VNODES_PER_WEIGHT = 2048
KEY_SIZE = 16
_KEY_DTYPE = np.dtype([("pos", ">u8"), ("rest", "V8")])


def key_positions(keys: bytes | Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """Ring positions of 16-byte keys (a sequence, or one blob of 16*n bytes)."""
    if isinstance(keys, bytes | bytearray | memoryview):
        blob = keys
    elif any(len(k) != KEY_SIZE for k in keys):
        raise InvalidKeyError(f"keys must be {KEY_SIZE} bytes each")
    else:
        blob = b"".join(keys)
    if len(blob) % KEY_SIZE:
        raise InvalidKeyError(f"keys must be {KEY_SIZE} bytes each")
    return np.frombuffer(blob, dtype=_KEY_DTYPE)["pos"].astype(np.uint64)


class Ring:
    """An immutable ring over ``weights`` (node id -> weight > 0).

    ``width`` is the most owners any caller will ask for (replication plus
    fallbacks); it is capped at the number of nodes.
    """

    def __init__(self, weights: Mapping[str, float], *, width: int = 3,
                 vnodes_per_weight: int = DEFAULT_VNODES_PER_WEIGHT) -> None:
        if not weights:
            raise ConfigError("a ring needs at least one node")
        if vnodes_per_weight < 1:
            raise ConfigError("vnodes_per_weight must be >= 1")
        if width < 1:
            raise ConfigError("width must be >= 1")
        for node, weight in weights.items():
            if not weight > 0:
                raise ConfigError(f"node {node!r} has weight {weight}; weights must be > 0")
        self.nodes: tuple[str, ...] = tuple(sorted(weights))
        self.weights = {n: float(weights[n]) for n in self.nodes}
        self.width = min(width, len(self.nodes))
        counts = [max(1, round(self.weights[n] * vnodes_per_weight)) for n in self.nodes]
        positions = np.empty(sum(counts), dtype=np.uint64)
        owners = np.empty(sum(counts), dtype=np.int32)
        at = 0
        for index, (node, count) in enumerate(zip(self.nodes, counts, strict=True)):
            digest = xxhash.xxh3_64_intdigest
            positions[at : at + count] = [digest(f"{node}#{i}".encode()) for i in range(count)]
            owners[at : at + count] = index
            at += count
        # ties (vanishingly rare) break by node index, so the order is deterministic
        order = np.lexsort((owners, positions))
        self.positions: npt.NDArray[np.uint64] = positions[order]
        table = self._successors(owners[order], self.width)
        # one row more, the first point's again: a position past the last point wraps to
        # the first with no fix-up of searchsorted's answer
        self._table = np.concatenate([table, table[:1]])

    @staticmethod
    def _successors(owner: npt.NDArray[np.int32], width: int) -> npt.NDArray[np.int32]:
        """Row p: the first ``width`` distinct owners clockwise from point p."""
        n = len(owner)
        table = np.full((n, width), -1, dtype=np.int32)
        table[:, 0] = owner
        filled = np.ones(n, dtype=np.int32)
        rows = np.arange(n)
        step = 1
        while step < n:
            todo = np.flatnonzero(filled < width)
            if len(todo) == 0:
                break
            candidate = owner[(todo + step) % n]
            seen = (table[todo] == candidate[:, None]).any(axis=1)
            new = todo[~seen]
            table[rows[new], filled[new]] = candidate[~seen]
            filled[new] += 1
            step += 1
        return table

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def num_points(self) -> int:
        return len(self.positions)

    @property
    def nbytes(self) -> int:
        """Memory held by the ring's arrays."""
        return int(self.positions.nbytes + self._table.nbytes)

    def owner_indexes(self, positions: npt.NDArray[np.uint64], r: int = 1
                      ) -> npt.NDArray[np.int32]:
        """``(len(positions), r)`` indexes into :attr:`nodes`, preferred owner first."""
        if not 1 <= r <= self.width:
            raise ValueError(f"r must be in 1..{self.width} for this ring, got {r}")
        point = np.searchsorted(self.positions, positions, side="left")
        # (``take`` of whole rows: ~4x faster than fancy indexing with a column slice)
        rows = self._table.take(point, axis=0)
        return rows if r == self.width else rows[:, :r]

    def owners_many(self, keys: bytes | Sequence[bytes], r: int = 1) -> list[list[str]]:
        """The owners of each key, preferred first."""
        nodes = self.nodes
        return [[nodes[i] for i in row] for row in self.owner_indexes(key_positions(keys), r)]

    def owners(self, key: bytes, r: int = 1) -> list[str]:
        """The first ``r`` distinct nodes clockwise from ``key``'s position."""
        return self.owners_many([key], r)[0]
