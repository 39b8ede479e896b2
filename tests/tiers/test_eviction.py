"""The DRAM tier's eviction policies, rule by rule, on small hand-made traces.

Each test replays requests as a client does (look up, read the cached prefix, store the
rest with parents) through the real :class:`DramTier` with its default policy (``chain``)
and checks one rule; where parametrised, beside what ``lru`` does with the same requests
(each such rule is one ``lru`` breaks). bench/policy.py replays whole traces.
"""

from __future__ import annotations

import pytest

from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE, seal
from kvpool.tiers.arena import ALIGN
from kvpool.tiers.dram import DramTier
from kvpool.tiers.eviction import ChainFIFO, eviction_order

PAGE = ALIGN
PAYLOAD = bytes(PAGE - ENVELOPE_HEADER_SIZE)


def chunk_keys(name: str, n: int) -> list[bytes]:
    """A chain of ``n`` keys (16 bytes each)."""
    return [f"{name}.{i}".encode().ljust(16, b"_") for i in range(n)]


def store(tier: DramTier, keys: list[bytes], first: int = 0) -> None:
    """Store ``keys[first:]`` one chunk a call, each with its parent (as the adapters do)."""
    for depth in range(first, len(keys)):
        slot = tier.reserve(keys[depth], PAGE)
        assert slot is not None
        slot.view[:ENVELOPE_HEADER_SIZE] = seal(PAYLOAD, chunk_index=depth)
        slot.view[ENVELOPE_HEADER_SIZE:] = PAYLOAD
        assert tier.commit([slot], parents=[keys[depth - 1] if depth else None])[0]


def request(tier: DramTier, keys: list[bytes], *, read: bool = True) -> int:
    """One request: look up, read the cached prefix (unless ``read`` is False: an engine
    that holds it in its own memory), store the rest. Its prefix hit, in chunks."""
    n = tier.lookup(keys)
    if read:
        for entry in tier.acquire_many(keys[:n]):
            assert entry is not None
            tier.release(entry)
    store(tier, keys, n)
    return n


def one_offs(tier: DramTier, count: int, name: str = "once") -> None:
    """``count`` requests of one chunk each, never seen before (for a new ``name``)."""
    for i in range(count):
        request(tier, chunk_keys(f"{name}{i}", 1))


@pytest.fixture(params=["chain", "lru"])
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_the_default_policy_is_chain() -> None:
    tier = DramTier(4 * PAGE)
    try:
        assert tier.policy == "chain"
    finally:
        tier.close()


def test_one_hit_wonders_leave_before_a_chain_that_was_hit(policy: str) -> None:
    """A conversation's context, read once, outlives a scan of one-off chunks longer than
    the tier: they leave from the probationary FIFO; LRU lets them push it out."""
    tier = DramTier(10 * PAGE, policy=policy)
    context = chunk_keys("ctx", 3)
    assert request(tier, context) == 0
    assert request(tier, context) == 3  # a second turn: read
    one_offs(tier, 12)
    assert request(tier, context) == (3 if policy == "chain" else 0)
    tier.close()


def test_a_chain_nobody_asked_for_again_leaves_like_any_one_off() -> None:
    """The rule above is not "keep the old": a context stored once and never looked up
    leaves when the scan passes."""
    tier = DramTier(10 * PAGE)
    context = chunk_keys("ctx", 3)
    request(tier, context)
    one_offs(tier, 12)
    assert tier.lookup(context) == 0
    tier.close()


def test_a_lookup_is_interest_without_a_read(policy: str) -> None:
    """An engine that holds the prefix itself looks it up and stores the rest, reading
    nothing: the lookup counts as a use (LRU does not count it)."""
    tier = DramTier(10 * PAGE, policy=policy)
    context = chunk_keys("ctx", 3)
    request(tier, context)
    assert request(tier, context, read=False) == 3
    one_offs(tier, 12)
    assert tier.lookup(context) == (3 if policy == "chain" else 0)
    tier.close()


def test_a_chain_stored_a_chunk_a_call_loses_its_tail_before_its_head(policy: str) -> None:
    """One chunk a call (what the engine adapters send), the head is the oldest: LRU
    evicts it first and the whole chain is dead; chain takes the tail first."""
    tier = DramTier(4 * PAGE, policy=policy)
    chain = chunk_keys("doc", 4)
    request(tier, chain)
    one_offs(tier, 1)
    assert tier.lookup(chain) == (3 if policy == "chain" else 0)
    tier.close()


def test_each_eviction_from_a_chain_takes_its_deepest_chunk_left() -> None:
    """A chain on probation, evicted a chunk at a time (the first victim each time, as a
    full tier asks for room): tail to head, each step from where the last one ended."""
    keys = [f"c{i}".encode() for i in range(6)]
    order = ChainFIFO(dict(zip(keys[1:], keys, strict=False)).get)
    for depth, key in enumerate(keys):
        order.touch([(key, depth)])
    evicted = []
    while (victim := order.first()) is not None:
        evicted.append(victim)
        order.discard(victim, evicted=True)
    assert evicted == keys[::-1]


def test_children_of_an_evicted_parent_go_next() -> None:
    """A chunk whose parent was evicted (here by place, or any way the tier picks) is
    worth nothing until the parent is back: it becomes the next victim, before older
    chunks that still serve a prefix."""
    order = ChainFIFO({b"c1": b"p", b"c2": b"c1"}.get)
    order.touch([(b"old", 0)])
    order.touch([(b"p", 0)])
    order.touch([(b"c1", 1)])
    order.touch([(b"c2", 2)])
    order.touch([(b"old", 0)])  # a use: it earns a pass
    order.discard(b"p", evicted=True)
    assert list(order.candidates())[:2] == [b"c2", b"c1"]
    lru = eviction_order("lru")
    for key, depth in [(b"old", 0), (b"p", 0), (b"c1", 1), (b"c2", 2)]:
        lru.touch([(key, depth)])
    lru.discard(b"p", evicted=True)
    assert next(lru.candidates()) == b"old"  # LRU keeps the orphans behind it


def test_a_parent_stored_again_takes_back_its_children() -> None:
    """A parent evicted and stored again heads its chain again: its children still held,
    read again, leave before it (tail before head), as they did before it left. (Before:
    the parent came back with no children, and left first, taking the chain's use with
    it while its tail stayed.)"""
    order = ChainFIFO({b"c1": b"p", b"c2": b"c1"}.get)
    for key, depth in [(b"p", 0), (b"c1", 1), (b"c2", 2)]:
        order.touch([(key, depth)])
    order.discard(b"p", evicted=True)  # its children: the next to go
    order.touch([(b"p", 0)])  # stored again (a ghost: into main)
    order.touch([(b"c1", 1), (b"c2", 2)])  # the whole chain read again
    ranked = list(order.candidates())
    assert ranked.index(b"c2") < ranked.index(b"c1") < ranked.index(b"p"), ranked
    # and a child stored while its parent is away (evicted lately) is linked when the
    # parent comes back
    order = ChainFIFO({b"c1": b"p"}.get)
    order.touch([(b"p", 0)])
    order.discard(b"p", evicted=True)
    order.touch([(b"c1", 1)])
    order.touch([(b"p", 0)])
    order.touch([(b"c1", 1)])
    ranked = list(order.candidates())
    assert ranked.index(b"c1") < ranked.index(b"p"), ranked


def test_a_ghost_stored_again_enters_main() -> None:
    """A chunk that left the small FIFO unused and comes back was asked for twice: it
    skips probation, and outlives a scan of one-offs."""
    tier = DramTier(10 * PAGE)
    context = chunk_keys("ctx", 3)
    request(tier, context)
    one_offs(tier, 12)  # it left unused: a ghost now
    assert request(tier, context) == 0  # stored again
    one_offs(tier, 12, "other")
    assert tier.lookup(context) == 3
    tier.close()


def test_a_chain_stored_in_one_call_is_linked_as_one_stored_a_chunk_a_call() -> None:
    """A batch (a vLLM save, a ``put_many``) enters deepest first, yet each chunk is
    linked to its parent in the batch: when the head is evicted, the rest of the chain,
    read since, goes next, as it does when stored a chunk a call. (Before: a batch's
    chunks were not linked, and an older chunk that still serves went first.)"""
    parents = {b"c1": b"p", b"c2": b"c1"}
    for one_call in (True, False):
        order = ChainFIFO(parents.get)
        order.touch([(b"old", 0)])
        chain = [(b"p", 0), (b"c1", 1), (b"c2", 2)]
        if one_call:
            order.touch(chain)
        else:
            for pair in chain:
                order.touch([pair])
        order.touch([(b"old", 0)])
        order.touch([(b"c1", 1), (b"c2", 2)])
        order.discard(b"p", evicted=True)
        assert list(order.candidates())[:2] == [b"c2", b"c1"], one_call


@pytest.mark.parametrize("proven", ["read", "stored_again"])
def test_a_chunk_that_extends_a_proven_chain_skips_probation(proven: str) -> None:
    """A conversation's next turn appends chunks to a context that was asked for again
    (read on probation, or stored again as a ghost): they enter main, as their parent
    did, and outlive a scan of one-offs. (Before: they went through probation and left
    with the scan, so the turn after missed them.)"""
    tier = DramTier(10 * PAGE)
    turn = chunk_keys("conv", 5)
    request(tier, turn[:3])
    if proven == "stored_again":
        one_offs(tier, 12, "early")  # the context left unused: a ghost
    assert request(tier, turn) == (3 if proven == "read" else 0)  # stores turn[3:]
    one_offs(tier, 12)
    assert tier.lookup(turn) == 5
    tier.close()


def test_a_new_branch_of_a_shared_prefix_still_goes_through_probation() -> None:
    """The rule above is for a chain's end only: a chunk whose parent has had a child
    (a system prompt that many contexts follow) starts on probation, or every new
    context behind a shared prompt would skip it."""
    tier = DramTier(10 * PAGE)
    system = chunk_keys("sys", 1)
    first = [*system, b"first".ljust(16, b"_")]
    request(tier, first)
    assert request(tier, first) == 2  # the prompt and its first follower: proven
    other = [*system, b"other".ljust(16, b"_")]
    assert request(tier, other) == 1
    one_offs(tier, 12)
    assert tier.lookup(other) == 1  # the prompt stays; the new branch left with the scan
    assert tier.lookup(first) == 2
    # and once every follower has left, the prompt is still a branching point, not a
    # chain's end: the next follower starts on probation too
    assert tier.delete_many([first[1], other[1]]) == [True, False]
    late = [*system, b"late".ljust(16, b"_")]
    assert request(tier, late) == 1
    one_offs(tier, 12, "again")
    assert tier.lookup(late) == 1
    tier.close()


def test_candidates_end_when_every_chunk_is_held_by_readers() -> None:
    """The tier skips chunks being read; the order offers each chunk once and stops."""
    tier = DramTier(3 * PAGE)
    keys = chunk_keys("held", 3)
    store(tier, keys)
    held = tier.acquire_many(keys)
    assert tier.reserve(b"x" * 16, PAGE) is None  # nothing evictable: no endless loop
    for entry in held:
        assert entry is not None
        tier.release(entry)
    assert tier.reserve(b"x" * 16, PAGE) is not None
    tier.close()


def test_a_cycle_of_parents_named_by_a_writer_does_not_loop() -> None:
    order = ChainFIFO({b"a": b"b", b"b": b"a"}.get)
    order.touch([(b"a", 0), (b"b", 1)])
    assert sorted(order.candidates()) == [b"a", b"b"]


def test_ghosts_are_bounded() -> None:
    order = ChainFIFO()
    for i in range(1000):
        key = i.to_bytes(4, "big")
        order.touch([(key, 0)])
        if len(order) > 4:
            victim = next(order.candidates())
            order.discard(victim, evicted=True)
    assert len(order) == 4
    assert len(order._ghost) <= max(ChainFIFO.GHOSTS * 4, 16)


def test_the_config_names_the_policies_the_tiers_run() -> None:
    from kvpool.server.config import POLICIES as CONFIG_POLICIES
    from kvpool.tiers.eviction import POLICIES as TIER_POLICIES

    assert CONFIG_POLICIES == TIER_POLICIES


def test_an_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        DramTier(4 * PAGE, policy="mru")


@pytest.mark.parametrize("policy", ["chain", "lru"])
def test_a_node_runs_the_policy_its_flag_names(policy: str) -> None:
    """Over TCP, as a client runs it: the one-hit-wonder rule holds with
    ``--dram-policy chain`` and not with ``lru``."""
    from kvpool.client import Client
    from tests.conftest import start_node

    node = start_node("--no-ssd", "--dram-capacity", str(10 * PAGE),
                      "--dram-allocate-ahead", "0", "--dram-policy", policy)
    try:
        with Client(node.url) as c:
            context = chunk_keys("ctx", 3)

            def store(keys: list[bytes], first: int) -> None:
                for depth in range(first, len(keys)):
                    c.put(keys[depth], PAYLOAD, chunk_index=depth,
                          parent=keys[depth - 1] if depth else None)

            store(context, 0)
            assert c.lookup(context) == 3
            assert all(v is not None for v in c.get_many(context))
            for i in range(12):
                store(chunk_keys(f"once{i}", 1), 0)
            assert c.lookup(context) == (3 if policy == "chain" else 0)
    finally:
        assert node.stop() == 0
