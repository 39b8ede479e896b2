"""The batch ops against a cluster: what each op sends to which nodes through the
:class:`~kvpool.client._router.Router`, and how the nodes' answers combine.

- put: to the first ``replication`` live nodes of each key's list; stored where any
  node stored it, else the refusal a node gave;
- get: nodes of the list one after another until one has the key, then the nodes
  that are draining (a chunk may still sit on the node moving out);
- exists: every live node of the list at once (draining nodes for what they did not
  find), the fastest tier wins;
- DELETE, PIN, UNPIN: every live node of the list; done where any node did it.

A one-node map (a standalone node, or a cluster of one) needs none of this: each op
sends the batch to that node whole (:meth:`Router.ask_sole`). Each op's routing is a
round plan (``put_rounds``, ``get_rounds``, ``exists_rounds``, ``statuses_rounds``;
``client/_rounds.py``) that the loop's driver runs here and the sync client's blocking
driver runs in its own thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from kvpool.client import _plans as plans
from kvpool.client._connection import BufferOrSegments
from kvpool.client._node import NodeClient
from kvpool.client._plans import rows_blob
from kvpool.client._rounds import RoundPlan, Routes, fan_out, then_each
from kvpool.client._router import Router, Rows
from kvpool.protocol.errors import KvpoolError, Status
from kvpool.protocol.frames import KEY_SIZE, Op
from kvpool.protocol.parsers import Segments

T = TypeVar("T")

__all__ = ["PutBatch", "exists_codes", "exists_rounds", "get", "get_rounds", "held_prefix",
           "put", "put_rounds", "statuses", "statuses_rounds"]


class PutBatch(NamedTuple):
    """A put_many's keys and values, and what goes with each (``client/_async.py``
    ``put_args``)."""

    bkeys: list[bytes]
    values: Sequence[BufferOrSegments]
    ttl_ms: int
    flags: int
    chunk_indexes: Sequence[int] | None
    num_tokens: int
    fingerprint: bytes
    parents: list[bytes | None] | None

    def part(self, rows: Rows) -> PutBatch:
        """The keys at ``rows``, with what goes with each."""
        chunk_indexes, parents = self.chunk_indexes, self.parents
        return self._replace(
            bkeys=[self.bkeys[i] for i in rows], values=[self.values[i] for i in rows],
            chunk_indexes=[chunk_indexes[i] for i in rows] if chunk_indexes is not None
            else None, parents=[parents[i] for i in rows] if parents else None)

    def items(self, node: NodeClient) -> list[plans.PutItem]:
        """As put items for ``node``'s limits (from its HELLO: a node met already)."""
        return plans.put_items(node, self.bkeys, self.values, ttl_ms=self.ttl_ms,
                               flags=self.flags, chunk_indexes=self.chunk_indexes,
                               parents=self.parents)

    def put_on(self, node: NodeClient) -> Awaitable[list[int]]:
        """``node.put`` of these keys (it connects first, if need be)."""
        return node.put(self.bkeys, self.values, ttl_ms=self.ttl_ms, flags=self.flags,
                        chunk_indexes=self.chunk_indexes, num_tokens=self.num_tokens,
                        fingerprint=self.fingerprint, parents=self.parents)


async def put(router: Router, batch: PutBatch) -> tuple[list[int], list[bool]]:
    """(a refusal status per key, OK where none; whether some node stored it)."""
    answer = await router.ask_sole(batch.put_on)
    if answer is not None:
        return answer, [s == Status.OK for s in answer]
    return await router.drive(put_rounds(router, batch),
                              lambda node, rows: batch.part(rows).put_on(node))


def put_rounds(routes: Routes, batch: PutBatch) -> RoundPlan[tuple[list[int], list[bool]]]:
    """A cluster put's rounds: each key to the first ``replication`` live nodes of its
    list (its fallbacks while an owner is down). (A refusal status per key, OK where
    none; whether some node stored it.)"""
    n = len(batch.bkeys)
    stored = np.zeros(n, dtype=bool)
    refused = np.full(n, Status.OK, dtype=np.int16)  # a status other than OK, if any

    def absorb(rows: Rows, answers: list[int]) -> None:
        arr = np.array(answers, dtype=np.int16)
        stored[rows] |= arr == Status.OK
        refused[rows] = np.where(arr != Status.OK, arr, refused[rows])

    yield from fan_out(routes, b"".join(batch.bkeys), absorb, per_row="owners")
    return refused.tolist(), stored.tolist()


async def get(router: Router, blob: bytes, sinks: Sequence[memoryview | Segments] | None
              ) -> list[memoryview | Segments | None]:
    """Each key's payload (in its sink, if given), None where no node has it."""
    views = await router.ask_sole(lambda node: node.get(blob, sinks))
    if views is not None:
        return views
    results: list[memoryview | Segments | None] = [None] * (len(blob) // KEY_SIZE)

    def send(node: NodeClient, rows: Rows) -> Awaitable[list[memoryview | Segments | None]]:
        return node.get(rows_blob(blob, rows), [sinks[i] for i in rows]
                        if sinks is not None else None)

    await router.drive(get_rounds(router, blob, results), send)
    return results


def get_rounds(routes: Routes, blob: bytes, results: list[memoryview | Segments | None]
               ) -> RoundPlan[None]:
    """A cluster GET's rounds (each node asked for some keys' payloads), filling
    ``results``: nodes of each key's list one after another until one has it, then the
    nodes that are draining (a chunk may still sit on the node moving out)."""

    def absorb(rows: Rows, views: list[memoryview | Segments | None]) -> npt.NDArray[np.bool_]:
        hit = np.zeros(len(rows), dtype=bool)
        for j, (row, view) in enumerate(zip(rows.tolist(), views, strict=True)):
            if view is not None:
                results[row] = view
                hit[j] = True
        return hit  # a hit ends the key's search

    yield from fan_out(routes, blob, absorb, per_row="all", sequential=True)
    draining = routes.draining()
    if draining:
        missing = np.array([i for i, r in enumerate(results) if r is None], dtype=np.intp)
        yield from then_each(draining, missing, absorb)


async def exists_codes(router: Router, blob: bytes) -> bytes:
    """The fastest tier holding each key as a ``Tier`` code, 0 where none does."""
    codes = await router.ask_sole(lambda node: node.exists(blob))
    if codes is not None:
        return codes

    def send(node: NodeClient, rows: Rows) -> Awaitable[bytes]:
        return node.exists(rows_blob(blob, rows))

    return await router.drive(exists_rounds(router, blob), send)


def exists_rounds(routes: Routes, blob: bytes) -> RoundPlan[bytes]:
    """A cluster EXISTS's rounds (each node asked for some keys' tier codes): the live
    nodes of each key's list at once (a node marked down (hung, say) is asked again once
    its back-off ends, not on every call: a scheduler asks for every request), then the
    draining nodes for the keys none had. Each key's code: the fastest tier any node
    gave."""
    best = np.full(len(blob) // KEY_SIZE, ABSENT, dtype=np.uint8)

    def absorb(rows: Rows, codes: bytes) -> None:
        fastest(best, rows, codes)

    def found(rows: Rows, codes: bytes) -> npt.NDArray[np.bool_]:
        fastest(best, rows, codes)
        return np.asarray(best[rows] != ABSENT, dtype=bool)

    yield from fan_out(routes, blob, absorb, per_row="live")
    draining = routes.draining()
    if draining:
        yield from then_each(draining, np.flatnonzero(best == ABSENT), found)
    return codes_of(best)


#: a key no node has answered for yet (a tier code is 1-3, 0 where a node lacks the key)
ABSENT = 255


def fastest(best: npt.NDArray[np.uint8], rows: npt.NDArray[np.intp], codes: bytes) -> None:
    """Keep in ``best`` (``ABSENT`` to begin with) the fastest tier any node gave for the
    keys at ``rows``, given one node's EXISTS ``codes`` for them."""
    arr = np.frombuffer(codes, dtype=np.uint8)
    best[rows] = np.minimum(best[rows], np.where(arr == 0, ABSENT, arr))


def codes_of(best: npt.NDArray[np.uint8]) -> bytes:
    """``best`` as ``exists_codes`` returns it: 0 where no node has the key."""
    best[best == ABSENT] = 0
    return best.tobytes()


async def lookup(router: Router, blob: bytes) -> Sequence[int]:
    """Tier codes of the leading keys held: a standalone node's own LOOKUP (it stops at
    its first miss), a cluster's EXISTS up to the first key none holds."""
    node = router.standalone_node
    if node is not None:
        return await node.lookup(blob)
    return held_prefix(await exists_codes(router, blob))


def held_prefix(codes: bytes) -> bytes:
    """A cluster's LOOKUP: the EXISTS ``codes`` of a prefix's keys up to the first miss."""
    return codes[: codes.index(0)] if 0 in codes else codes


async def statuses(router: Router, op: Op, blob: bytes) -> list[bool]:
    """DELETE/PIN/UNPIN: True where some node did it."""
    answers = await router.ask_sole(lambda node: node.statuses(op, blob))
    if answers is not None:
        return [s == Status.OK for s in answers]

    def send(node: NodeClient, rows: Rows) -> Awaitable[list[int]]:
        return node.statuses(op, rows_blob(blob, rows))

    return await router.drive(statuses_rounds(router, blob), send)


def statuses_rounds(routes: Routes, blob: bytes) -> RoundPlan[list[bool]]:
    """DELETE/PIN/UNPIN's rounds: every node of each key's list; True where some node
    did it."""
    done = np.zeros(len(blob) // KEY_SIZE, dtype=bool)

    def absorb(rows: Rows, answers: list[int]) -> None:
        done[rows] |= np.array(answers) == Status.OK

    yield from fan_out(routes, blob, absorb, per_row="all")
    return done.tolist()


async def node_stats(router: Router) -> dict[str, Any]:
    """Each node's STATS by node id, asked at once; ``{"error": ...}`` for a node that
    failed with a kvpool error (any other error is raised)."""
    nodes = list(router.nodes.values())
    answers = await asyncio.gather(*(n.json_op(Op.STATS) for n in nodes),
                                   return_exceptions=True)
    out: dict[str, Any] = {}
    for node, answer in zip(nodes, answers, strict=True):
        if isinstance(answer, KvpoolError):
            out[node.node_id] = {"error": str(answer)}
        elif isinstance(answer, BaseException):
            raise answer
        else:
            out[node.node_id] = answer
    return out


async def map_dict(router: Router) -> dict[str, Any]:
    """The map as a node serves it: a standalone node's own view (the address it serves
    on, "source"), or the cluster map the client routes by."""
    node = router.standalone_node
    if node is not None:
        return await node.json_op(Op.CLUSTER)
    assert router.map is not None
    return router.map.to_dict()
