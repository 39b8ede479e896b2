"""Eviction orders, and expiry order (soonest deadline first: :class:`Deadlines`).

Two policies, chosen per node (``--dram-policy``; docs/tiers.md has the measurements):

``chain`` (:class:`ChainFIFO`, the default): S3-FIFO (Yang et al., SOSP '23) fitted to
chained prefix chunks. A new chunk enters a small probationary FIFO (a tenth of the
chunks); one that is read or looked up there before it reaches the FIFO's head moves to
the main FIFO, one that is not leaves and is remembered as a ghost (its key only), and a
ghost stored again enters main directly. Main gives a chunk used since its last pass
one more pass (one, not S3-FIFO's three: reuse in a pool comes in sessions, a
conversation's turns or an agent's steps, and a chunk used often in a session that has
ended would outstay chunks of live ones). Most chunks of a KV pool are never asked for
again (the last chunks of a conversation's last turn, one-off documents): they leave
from the small FIFO without pushing out chunks that will be hit. Rules for chains: a
chunk is worth no more than its parent, so when a parent is evicted its children still
held become the next to go (a prefix lookup stops at the parent anyway); a chunk chosen
to go takes its descendants first, deepest first, so a chain's tail leaves before its
head whenever it was stored; a new chunk that extends a chain whose end was asked for
again (its parent in main or used on probation, and never a parent before) skips
probation, as a live conversation's next turn; a batch is linked to its parents as if
stored a chunk a call, and enters deepest first; and a lookup that finds a chunk
counts as a use (an engine that holds the prefix itself looks up and stores but reads
nothing).

``lru`` (:class:`PrefixAwareLRU`, the tiers' policy before ``chain``, kept for
comparison and for the cold tiers): least recently used first; at equal recency, deepest
first. Lookups do not count as uses.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

__all__ = ["POLICIES", "ChainFIFO", "Deadlines", "EvictionOrder", "PrefixAwareLRU",
           "eviction_order"]

T = TypeVar("T")


class EvictionOrder(Protocol):
    """What a :class:`~kvpool.tiers.ledger.Ledger` asks of its eviction policy."""

    def __len__(self) -> int: ...

    def __contains__(self, key: bytes) -> bool: ...

    def touch(self, batch: Iterable[tuple[bytes, int]]) -> Sequence[bytes]:
        """``(key, depth)`` pairs were stored or read now, together (adds unknown keys).
        The keys added that the policy remembers evicting (stored again)."""

    def notice(self, keys: Iterable[bytes]) -> None:
        """Held ``keys`` were looked up (found) without being read."""

    def discard(self, key: bytes, *, evicted: bool = False) -> None:
        """``key`` left the order: evicted to make room, or deleted, replaced or pinned."""

    def candidates(self) -> Iterator[bytes]:
        """Keys from first to last to evict. The caller evicts none while iterating."""

    def first(self) -> bytes | None:
        """The first of :meth:`candidates` (None: none), without starting an iteration."""


#: the eviction policies a tier can run, by the name a node's config gives them
POLICIES = ("chain", "lru")


def eviction_order(name: str, parent_of: Callable[[bytes], bytes | None] | None = None
                   ) -> EvictionOrder:
    """A new, empty eviction order of policy ``name`` (one of :data:`POLICIES`).
    ``parent_of`` tells a held key's parent, where its writer said (for ``chain``)."""
    if name == "lru":
        return PrefixAwareLRU()
    if name == "chain":
        return ChainFIFO(parent_of)
    raise ValueError(f"unknown eviction policy {name!r} (one of {', '.join(POLICIES)})")


class PrefixAwareLRU:
    """Tracks evictable keys; ``candidates()`` yields them in eviction order."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    def touch(self, batch: Iterable[tuple[bytes, int]]) -> Sequence[bytes]:
        """Mark ``(key, depth)`` pairs as used now, together (adds unknown keys)."""
        order = self._order
        for key, _depth in sorted(batch, key=lambda kd: -kd[1]):
            order[key] = None
            order.move_to_end(key)
        return ()  # (no memory of what it evicted)

    def notice(self, keys: Iterable[bytes]) -> None:
        """Lookups are not uses here (the policy as it was)."""

    def discard(self, key: bytes, *, evicted: bool = False) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        """Keys from first to last to evict. Do not mutate while iterating."""
        return iter(self._order)

    def first(self) -> bytes | None:
        return next(iter(self._order), None)


class _Chunk:
    """What :class:`ChainFIFO` keeps of a chunk held."""

    __slots__ = ("children", "hint", "parent", "small", "uses")

    def __init__(self, small: bool, parent: bytes | None,
                 children: set[bytes] | None) -> None:
        self.uses = 0  #: passes earned (0 to MAX_USES)
        self.small = small  #: in the small FIFO (else in main)
        self.parent = parent  #: its parent's key, where the writer said
        #: its children held, linked when stored (None: it never had one here)
        self.children = children
        #: where the last walk from it to its deepest descendant ended (_leaf)
        self.hint: bytes | None = None


class ChainFIFO:
    """S3-FIFO for chained prefix chunks (the module doc has the rules).

    State a held chunk: an entry in one FIFO, a :class:`_Chunk` (use count, parent, its
    children held) and one in its parent's set of children: about 420 bytes. Ghosts
    (keys only, about 250 bytes each) are at most :attr:`GHOSTS` per chunk held. O(1)
    per store, read and lookup; an eviction passes over chunks that earned another pass
    (one per use) and walks to a chain's deepest chunk from where its
    last walk ended.
    """

    __slots__ = ("_evictions", "_ghost", "_main", "_orphans", "_parent_of", "_small",
                 "_small_target", "_state")

    #: the small FIFO's share of the chunks held
    SMALL_SHARE = 0.1
    #: passes a chunk can hold in the main FIFO (uses since its last pass, at most)
    MAX_USES = 1
    #: ghosts kept, per chunk held
    GHOSTS = 8
    #: chunks the small FIFO's target grows (or shrinks) by at each ghost stored again
    #: that a bigger small FIFO (or main) would have kept
    ADAPT = 1.0

    def __init__(self, parent_of: Callable[[bytes], bytes | None] | None = None) -> None:
        self._small: OrderedDict[bytes, None] = OrderedDict()
        self._main: OrderedDict[bytes, None] = OrderedDict()
        #: keys evicted lately -> (when, by eviction count) * 2 + (1 if from the small FIFO)
        self._ghost: OrderedDict[bytes, int] = OrderedDict()
        self._evictions = 0
        self._small_target = 0.0
        self._state: dict[bytes, _Chunk] = {}
        #: chunks held whose parent left this tier (or was a ghost when they came), by
        #: the parent's key: the parent, stored again, takes them back as its children.
        #: (A parent never held here, as on another node of a cluster, is not waited for.)
        self._orphans: dict[bytes, set[bytes]] = {}
        self._parent_of = parent_of

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, key: bytes) -> bool:
        return key in self._state

    def touch(self, batch: Iterable[tuple[bytes, int]]) -> Sequence[bytes]:
        state = self._state
        if type(batch) is list and len(batch) == 1:  # (most calls: one chunk)
            key = batch[0][0]
            chunk = state.get(key)
            if chunk is not None:
                if chunk.uses < self.MAX_USES:
                    chunk.uses += 1
                return ()
            return (key,) if self._admit(key, True) else ()
        most = self.MAX_USES
        new: list[tuple[bytes, int]] | None = None
        for key, depth in batch:
            chunk = state.get(key)
            if chunk is None:
                if new is None:
                    new = [(key, depth)]
                else:
                    new.append((key, depth))
            elif chunk.uses < most:
                chunk.uses += 1
        if new is None:
            return ()
        if len(new) == 1:
            key = new[0][0]
            return (key,) if self._admit(key, True) else ()
        new.sort(key=lambda kd: -kd[1])  # deepest first, else as given: the tail leaves first
        # held parents first (linked to them, and ranked by them), then into the FIFOs
        recalled_keys = [key for key, _depth in reversed(new) if self._admit(key, False)]
        small, main = self._small, self._main
        for key, _depth in new:
            (small if state[key].small else main)[key] = None
        return recalled_keys or ()

    def notice(self, keys: Iterable[bytes]) -> None:
        state = self._state
        for key in keys:
            chunk = state.get(key)
            if chunk is not None and not chunk.uses:
                chunk.uses = 1

    def _admit(self, key: bytes, enqueue: bool) -> bool:
        """Hold ``key`` (``enqueue``: in its FIFO too, else the caller puts it there);
        whether it came back as a ghost."""
        state = self._state
        mark = self._ghost.pop(key, None)
        parent = self._parent_of(key) if self._parent_of is not None else None
        up = state.get(parent) if parent is not None else None
        # a ghost stored again skips probation, and so does a chunk that extends a chain
        # whose end was asked for again (in main, or used on probation) and never had a
        # child here (a new branch of a shared prompt is not a next turn)
        extends = up is not None and up.children is None and (not up.small or up.uses > 0)
        small = mark is None and not extends
        state[key] = _Chunk(small, parent, self._orphans.pop(key, None) if self._orphans
                            else None)
        if enqueue:
            (self._small if small else self._main)[key] = None
        if mark is not None and self.ADAPT and self._evictions - (mark >> 1) <= len(state):
            # evicted lately: a bigger FIFO (the small one, or main) would have kept it
            held = len(state)
            target = self._small_target + (self.ADAPT if mark & 1 else -self.ADAPT)
            self._small_target = min(max(target, self.SMALL_SHARE * held), 0.9 * held)
        if up is not None:
            if up.children is None:
                up.children = {key}
            else:
                up.children.add(key)
        elif parent is not None and parent in self._ghost:  # evicted lately: it may come back
            self._orphans.setdefault(parent, set()).add(key)
        return mark is not None

    def discard(self, key: bytes, *, evicted: bool = False) -> None:
        state = self._state
        chunk = state.pop(key, None)
        if chunk is None:
            return
        if chunk.small:
            del self._small[key]
        else:
            del self._main[key]
        if chunk.parent is not None:
            up = state.get(chunk.parent)
            if up is not None:
                if up.children is not None:
                    up.children.discard(key)
            else:
                waiting = self._orphans.get(chunk.parent)
                if waiting is not None:
                    waiting.discard(key)
                    if not waiting:
                        del self._orphans[chunk.parent]
        if chunk.children:  # they wait for it now (a chunk deleted or evicted alike)
            self._orphans[key] = chunk.children
        if not evicted:
            return
        self._evictions += 1
        ghost = self._ghost
        ghost[key] = self._evictions * 2 + chunk.small
        limit = self.GHOSTS * len(state)
        while len(ghost) > limit and len(ghost) > 16:
            ghost.popitem(last=False)
        if chunk.children:  # worth nothing until their parent is back: the next to go
            for child in chunk.children:
                orphan = state[child]
                orphan.uses = 0
                (self._small if orphan.small else self._main).move_to_end(child, last=False)

    def first(self) -> bytes | None:
        small, state = self._small, self._state
        n = len(small)
        if n and n > self._small_target and n > self.SMALL_SHARE * len(state):
            head = next(iter(small))  # (the common case: _probation_head's, inlined)
            top = state[head]
            if not top.uses:
                if not top.children:
                    return head
                hint = top.hint  # (_leaf's first step, inlined: the hinted chunk a leaf)
                if hint is not None and hint != head:
                    hinted = state.get(hint)
                    if hinted is not None and not hinted.children:
                        top.hint = hinted.parent
                        return hint
                return self._leaf(head, top)
        return next(self.candidates(), None)

    def candidates(self) -> Iterator[bytes]:
        small = self._small
        first = None
        head = self._probation_head()
        if head is not None:  # the common case: no pass over either FIFO
            first = self._leaf(head, self._state[head])
            yield first
            if first == head and head in small:  # passed over (being read): as below
                small.move_to_end(head)
        yield from self._candidates(first)

    def _probation_head(self) -> bytes | None:
        """The small FIFO's head when it is the next to go as it stands (unused, and the
        small FIFO over its target); else None (the general walk decides)."""
        small = self._small
        n = len(small)
        if not n or n <= self._small_target or n <= self.SMALL_SHARE * len(self._state):
            return None
        key = next(iter(small))
        return None if self._state[key].uses else key

    def _leaf(self, head: bytes, top: _Chunk) -> bytes:
        """A deepest descendant of ``head`` (whose state is ``top``) held (``head`` itself
        if none), by first children (at most as many steps as chunks held: a writer may
        name any key as a parent). The walk starts where the last one from ``head`` ended
        (that leaf's parent, still a descendant): a long chain loses its tail in O(1) a
        chunk."""
        if not top.children:  # (most calls: no descendants held)
            return head
        state = self._state
        key, chunk = head, top
        hint = top.hint
        if hint is not None and (hinted := state.get(hint)) is not None:
            key, chunk = hint, hinted
        for _ in range(len(state)):
            if not chunk.children:
                break
            key = next(iter(chunk.children))
            chunk = state[key]
        top.hint = chunk.parent if key != head else None
        return key

    def _candidates(self, first: bytes | None) -> Iterator[bytes]:
        """Every candidate in order (``first``: offered already)."""
        small, main, state = self._small, self._main, self._state
        offered: set[bytes] = set()
        small_offered = 0
        if first is not None:
            offered.add(first)
            small_offered = first in small
        floor = self.SMALL_SHARE * len(state)
        target = floor if floor > self._small_target else self._small_target
        small_done = main_done = False
        while not (small_done and main_done):
            if not small_done and (main_done or not main
                                   or len(small) - small_offered > target - len(offered)):
                if not small:
                    small_done = True
                    continue
                key = next(iter(small))
                if key in offered:  # every chunk of it offered once
                    small_done = True
                    continue
                chunk = state[key]
                if chunk.uses:  # used on probation: into main
                    del small[key]
                    main[key] = None
                    chunk.small = False
                    chunk.uses = 0
                    continue
                queue = small
            else:
                if not main:
                    main_done = True
                    continue
                key = next(iter(main))
                if key in offered:
                    main_done = True
                    continue
                chunk = state[key]
                if chunk.uses:  # one more pass
                    chunk.uses -= 1
                    main.move_to_end(key)
                    continue
                queue = main
            # the deepest descendant first (most calls end with it: the caller takes it),
            # then the others tail first, then the chunk itself
            victims = (key,) if not chunk.children \
                else itertools.chain((self._leaf(key, chunk),), self._tail_first(key))
            for victim in victims:
                if victim not in offered:
                    offered.add(victim)
                    small_offered += victim in small
                    yield victim
            if key in queue:
                queue.move_to_end(key)

    def _tail_first(self, key: bytes) -> Iterator[bytes]:
        """``key``'s descendants held, each after its own (a chain's tail before its
        head: a chunk is worth no more than its parent), then ``key``."""
        state = self._state
        seen = {key}  # (a writer may name any key as a parent: no cycles followed)
        stack = [(key, iter(state[key].children or ()))]
        while stack:
            node, rest = stack[-1]
            child = next(rest, None)
            if child is None:
                stack.pop()
                yield node
            elif child not in seen:
                seen.add(child)
                stack.append((child, iter(state[child].children or ())))


class Deadlines(Generic[T]):
    """Items by deadline, soonest first (a heap). An item whose deadline changed, or that
    went away, stays in it until it comes up: the caller checks it then."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()  # ties never compare the items

    def add(self, at: float, item: T) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), item))

    @property
    def next_at(self) -> float:
        """The soonest deadline (inf when none): nothing is due before it."""
        heap = self._heap
        return heap[0][0] if heap else math.inf

    def due(self, now: float) -> Iterator[tuple[float, T]]:
        """Take out the items whose deadline is ``now`` or past, soonest first."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _, item = heapq.heappop(heap)
            yield at, item
