"""Reads in place (``read_in_place``: a value handed over where it lies in a same-host
node's memory, no request, no copy) against real node processes: the bytes are the
value's and the read is reported like any other; a key the index lacks, a value freed
while it was being read, or a client that may not read so answers False; the GPU
client's loads into CPU blocks fall back to a received copy for such a chunk and stay
bit-exact."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from kvpool.client import AsyncClient, Client
from kvpool.client import _shm as shm_module
from kvpool.client._shm import ShmMapping
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE
from kvpool.protocol.frames import ShmItem
from tests.conftest import node_stats, shm_node, start_node

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _mapping(client: Client) -> ShmMapping:
    mapping = shm_node(client).path.mapping
    assert mapping is not None
    return mapping


def _replace_from_another_client(url: str, key: bytes, value: bytes) -> None:
    """Delete ``key`` and store it again (its memory freed, the generation bumped)."""
    def work() -> None:
        with Client(url, shm=False) as other:
            other.delete(key)
            other.put(key, value)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(30)


def test_a_value_is_handed_over_where_it_lies_with_no_request() -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        key, value = os.urandom(16), os.urandom((1 << 20) + 3)
        with Client(node.url, shm=True) as fast:
            fast.put(key, value)
            mapping = _mapping(fast)
            seen: list[bytes] = []

            def consume(view: memoryview) -> None:
                assert view.obj is mapping.view.obj  # the arena itself, not a copy
                seen.append(bytes(view))

            requests = dict(node_stats(node)["requests"])
            assert fast.read_in_place(key, consume)
            assert seen == [value]
            after = node_stats(node)["requests"]
            assert (after["get"], after["get_shm"]) == (requests["get"], requests["get_shm"])
            assert fast.bytes_by_path["shm"] == len(value)
            # not in the index: False, and nothing is handed over
            assert not fast.read_in_place(os.urandom(16), consume) and len(seen) == 1
            fast.stats()  # reports the reads through the index (TOUCH) first
        shm = node_stats(node)["shm"]
        # the node counts the value as stored, its envelope included
        assert (shm["index_items_out"], shm["index_bytes_out"]) == (
            1, len(value) + ENVELOPE_HEADER_SIZE)
    finally:
        assert node.stop() == 0


def test_a_value_freed_while_it_is_read_answers_false() -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        key, old, new = os.urandom(16), os.urandom(1 << 20), os.urandom(1 << 20)
        with Client(node.url, shm=True) as fast:
            fast.put(key, old)
            mapping = _mapping(fast)
            generations: list[tuple[int, int]] = []

            def replace(item: ShmItem) -> None:
                mapping.after_copy = None  # once
                _replace_from_another_client(node.url, key, new)
                generations.append((item.generation, int(mapping.gens[item.offset // 4096])))

            mapping.after_copy = replace  # between the consumer and the generation check
            calls: list[int] = []
            assert not fast.read_in_place(key, lambda view: calls.append(view.nbytes))
            assert calls == [1 << 20]  # it ran: the caller must redo what it did
            assert len(generations) == 1 and generations[0][0] != generations[0][1]
            node_client = fast.async_client._router.standalone_node
            assert node_client is not None and node_client.path.index_stale == 1
            seen: list[bytes] = []
            assert fast.read_in_place(key, lambda view: seen.append(bytes(view)))
            assert seen == [new]
    finally:
        assert node.stop() == 0


def test_clients_that_may_not_read_in_place_answer_false(
        monkeypatch: pytest.MonkeyPatch) -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        key, value = os.urandom(16), os.urandom(4096)
        calls: list[int] = []
        with Client(node.url, shm=False) as tcp:
            tcp.put(key, value)
            assert not tcp.read_in_place(key, lambda view: calls.append(1))
            assert not tcp.async_client.can_read_in_place
        with Client(node.url, shm=True, shm_index=False) as leased:
            leased.exists(key)
            assert not leased.read_in_place(key, lambda view: calls.append(1))
        with Client(node.url, shm=True) as fast:
            fast.exists(key)
            assert fast.async_client.can_read_in_place
            # elsewhere than x86-64 a consumer's reads may pass the generation check's
            monkeypatch.setattr(shm_module, "HASH_SOURCE", False)
            monkeypatch.setattr("kvpool.client._shm_path.HASH_SOURCE", False)
            assert not fast.read_in_place(key, lambda view: calls.append(1))
        assert calls == []
    finally:
        assert node.stop() == 0


async def test_the_async_client_reads_in_place_and_reports_it() -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        key, value = os.urandom(16), os.urandom(8192)
        async with AsyncClient(node.url, shm=True) as fast:
            await fast.put(key, value)
            seen: list[bytes] = []
            assert fast.read_in_place(key, lambda view: seen.append(bytes(view)))
            assert seen == [value]
            await fast.stats()
        assert node_stats(node)["shm"]["index_items_out"] == 1
    finally:
        assert node.stop() == 0


def test_a_chunk_freed_while_scattered_is_loaded_again_from_a_copy() -> None:
    torch = pytest.importorskip("torch")
    from kvpool.gpu import KVLayout, PagedKVConnector

    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        layout = KVLayout(3, 2, 8, torch.bfloat16, 4, kind="cpu_attn")
        ns = layout.namespace(f"in-place-{os.urandom(4).hex()}", chunk_tokens=16)
        tokens = list(range(4 * 16))
        g = torch.Generator().manual_seed(3)
        src = [torch.randn(layout.layer_shape(16), generator=g).to(layout.dtype)
               for _ in range(3)]
        with Client(node.url, shm=True) as client:
            with PagedKVConnector(client, layout, src, ns) as a:
                assert a.store(tokens, list(range(16))) == 64
                keys = a._async.hasher.keys(tokens)
            raw = client.get(keys[2])
            assert raw is not None
            mapping = _mapping(client)
            replaced: list[int] = []

            def replace(item: ShmItem) -> None:  # the third chunk, while it is scattered
                if item.length - 64 == len(raw) and not replaced:
                    slot = mapping.index.find(keys[2]) if mapping.index is not None else None
                    if slot is not None and slot.offset == item.offset:
                        replaced.append(item.offset)
                        mapping.after_copy = None
                        _replace_from_another_client(node.url, keys[2], bytes(raw))

            mapping.after_copy = replace
            dst = [torch.zeros(layout.layer_shape(16)).to(layout.dtype) for _ in range(3)]
            with PagedKVConnector(client, layout, dst, ns) as b:
                assert b.load(tokens, list(range(16))) == 64
                assert replaced and b.stats.chunks_in_place == 3  # one received instead
            for want, got in zip(src, dst, strict=True):
                assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
            node_client = client.async_client._router.standalone_node
            assert node_client is not None and node_client.path.index_stale == 1
    finally:
        assert node.stop() == 0
