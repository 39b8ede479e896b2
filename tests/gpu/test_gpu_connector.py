"""PagedKVConnector against a real node, on CPU tensors (the same code path as CUDA):
round trips for every paged layout, prefix loads, skip-on-store, corrupt and missing
chunks ending a load early, and up-front layout checks."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from kvpool.client import Client  # noqa: E402
from kvpool.gpu import KVLayout, PagedKVConnector  # noqa: E402
from kvpool.gpu.layout import ChunkFormat, LayoutKind  # noqa: E402
from kvpool.gpu.paged import CpuAttnScatter, gather, scatter  # noqa: E402
from kvpool.protocol.errors import LayoutError  # noqa: E402
from tests.conftest import NodeProcess, put_corrupt  # noqa: E402

BLOCK = 4
CHUNK = 16  # 4 blocks per chunk
LAYOUTS = {
    "flash": KVLayout(3, 2, 8, torch.float32, BLOCK, kind="flash"),
    "blocks_first": KVLayout(3, 2, 8, torch.bfloat16, BLOCK, kind="blocks_first"),
    "mla": KVLayout.mla(3, 24, torch.float16, BLOCK),
    "cpu_attn": KVLayout(3, 2, 8, torch.bfloat16, BLOCK, kind="cpu_attn"),
    # vLLM CPU's own block bytes as the chunk (no transpose; direct on the CPU)
    "cpu_attn_engine": KVLayout(3, 2, 8, torch.bfloat16, BLOCK, kind="cpu_attn",
                                chunk_format="engine"),
    # vLLM >= 0.32's GPU views, [B, H, N, 2D] over memory laid out as vLLM's LBNHC (the
    # old NHD: tokens before heads) and BLHNC (blocks outermost, the layers interleaved)
    "bhnc_lbnhc": KVLayout(3, 2, 8, torch.bfloat16, BLOCK, kind="bhnc"),
    "bhnc_blhnc": KVLayout(3, 2, 8, torch.float32, BLOCK, kind="bhnc"),
}
#: physical order of [L, B, H, N, C] for the bhnc layouts (vLLM's KVCacheLayout values)
BHNC_ORDER = {"bhnc_lbnhc": (0, 1, 3, 2, 4), "bhnc_blhnc": (1, 0, 2, 3, 4)}


def make_caches(layout: KVLayout, num_blocks: int, seed: int,
                kind: str = "") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind in BHNC_ORDER:  # one buffer in vLLM's physical order, viewed per layer
        order = BHNC_ORDER[kind]
        logical = (layout.num_layers, *layout.layer_shape(num_blocks))
        physical = torch.randn([logical[d] for d in order], generator=g).to(layout.dtype)
        views = physical.permute(*[order.index(d) for d in range(5)]).unbind(0)
        assert not views[0].is_contiguous()
        return list(views)
    return [torch.randn(layout.layer_shape(num_blocks), generator=g).to(layout.dtype)
            for _ in range(layout.num_layers)]


def token_rows(layout: KVLayout, caches: list[torch.Tensor], block_ids: list[int],
               num_tokens: int) -> torch.Tensor:
    """The per-token K/V of the first ``num_tokens`` tokens, engine-layout independent:
    [tokens, layers, kv, heads, dim] (MLA: [tokens, layers, dim])."""
    rows = []
    for t in range(num_tokens):
        block, offset = block_ids[t // BLOCK], t % BLOCK
        if layout.kind == "flash":
            rows.append(torch.stack([c[:, block, offset] for c in caches]))
        elif layout.kind == "blocks_first":
            rows.append(torch.stack([c[block, :, offset] for c in caches]))
        elif layout.kind == "bhnc":  # a token's content is its K then its V
            h, d = layout.num_kv_heads, layout.head_dim
            rows.append(torch.stack([c[block, :, offset].reshape(h, 2, d).transpose(0, 1)
                                     for c in caches]))
        elif layout.kind == "cpu_attn":  # per head: K column-major [D, B], V row-major [B, D]
            h, d = layout.num_kv_heads, layout.head_dim
            flat = [c[block].reshape(h, 2 * BLOCK * d) for c in caches]
            rows.append(torch.stack([torch.stack([
                f[:, : BLOCK * d].view(h, d, BLOCK)[:, :, offset],
                f[:, BLOCK * d :].view(h, BLOCK, d)[:, offset]]) for f in flat]))
        else:
            rows.append(torch.stack([c[block, offset] for c in caches]))
    return torch.stack(rows)


@pytest.fixture
def client(node: NodeProcess) -> Iterator[Client]:
    with Client(node.url) as c:
        yield c


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "received"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_store_then_load_into_other_blocks_is_bit_exact(kind: str, direct: bool,
                                                        in_place: bool, client: Client
                                                        ) -> None:
    layout = LAYOUTS[kind]
    if layout.converts and direct:
        with pytest.raises(LayoutError, match="staging"):
            PagedKVConnector(client, layout, make_caches(layout, 8, 0, kind),
                             layout.namespace("x", chunk_tokens=CHUNK), direct=True)
        direct = False  # both ends staged
    ns = layout.namespace(f"test-{kind}-{os.urandom(4).hex()}", chunk_tokens=CHUNK)
    tokens = list(range(1000, 1000 + 3 * CHUNK + 5))  # 3 full chunks + 5 tokens
    src = make_caches(layout, 32, seed=1, kind=kind)
    src_blocks = [7, 3, 30, 12, 0, 1, 2, 9, 10, 11, 4, 5, 6, 8]  # 14 blocks: 56 tokens
    with PagedKVConnector(client, layout, src, ns, staging_slots=2, direct=direct) as a:
        assert a.store(tokens, src_blocks) == 3 * CHUNK
        assert a.store(tokens, src_blocks) == 0  # already there: one EXISTS, no puts
        assert a.stats.chunks_skipped == 3

    dst = make_caches(layout, 40, seed=2, kind=kind)
    untouched = [c.clone() for c in dst]
    dst_blocks = list(range(39, 25, -1))
    with PagedKVConnector(client, layout, dst, ns, staging_slots=2,
                          direct=not direct and not layout.converts, in_place=in_place) as b:
        assert b.load(tokens, dst_blocks) == 3 * CHUNK
        assert b.stats.bytes_loaded == 3 * layout.chunk_nbytes(CHUNK)
        # a staged load on CPU scatters each chunk from the node's memory (same host)
        staged = direct or layout.converts
        assert b.stats.chunks_in_place == (3 if staged and in_place else 0)
    want = token_rows(layout, src, src_blocks, 3 * CHUNK)
    got = token_rows(layout, dst, dst_blocks, 3 * CHUNK)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # blocks outside the loaded ones are untouched
    loaded = set(dst_blocks[: 3 * CHUNK // BLOCK])
    for before, after in zip(untouched, dst, strict=True):
        for blk in set(range(40)) - loaded:
            sel = (slice(None), blk) if kind == "flash" else (blk,)
            assert torch.equal(before[sel], after[sel])


@pytest.mark.parametrize(("kind", "direct"), [
    ("flash", False), ("flash", True), ("mla", False), ("mla", True),
    ("cpu_attn", False),  # canonical cpu_attn chunks always go through staging
    ("cpu_attn_engine", False), ("cpu_attn_engine", True),
    ("bhnc_lbnhc", False), ("bhnc_blhnc", False)])
def test_a_load_skips_the_blocks_the_engine_already_holds(kind: str, direct: bool,
                                                          client: Client) -> None:
    """skip_tokens mid-chunk: the chunk is fetched, but only its later blocks are written
    (a direct load receives the held blocks' bytes into a scratch buffer)."""
    layout = LAYOUTS[kind]
    ns = layout.namespace(f"skip-{kind}-{os.urandom(4).hex()}", chunk_tokens=CHUNK)
    tokens = list(range(3 * CHUNK))
    src = make_caches(layout, 16, seed=5, kind=kind)
    with PagedKVConnector(client, layout, src, ns, direct=False) as a:
        assert a.store(tokens, list(range(12))) == 3 * CHUNK
    dst = make_caches(layout, 16, seed=6, kind=kind)
    before = [c.clone() for c in dst]
    skip = CHUNK + BLOCK  # one chunk and one block of the next are the engine's own
    with PagedKVConnector(client, layout, dst, ns, direct=direct) as b:
        assert b.load(tokens, list(range(12)), skip_tokens=skip) == 3 * CHUNK
        assert b.stats.tokens_loaded == 2 * CHUNK  # chunks 1 and 2 fetched
        with pytest.raises(LayoutError, match="multiple of the block size"):
            b.load(tokens, list(range(12)), skip_tokens=BLOCK + 1)
    got, want = (token_rows(layout, c, list(range(12)), 3 * CHUNK) for c in (dst, src))
    assert torch.equal(got[skip:].view(torch.uint8), want[skip:].view(torch.uint8))
    kept = token_rows(layout, before, list(range(12)), skip)
    assert torch.equal(got[:skip].view(torch.uint8), kept.view(torch.uint8))


def test_an_engine_format_chunk_is_the_blocks_bytes_layer_by_layer() -> None:
    layout = LAYOUTS["cpu_attn_engine"]
    caches = make_caches(layout, 8, seed=3)
    ids = torch.tensor([5, 1, 2, 7])
    chunk = torch.empty(layout.chunk_shape(CHUNK), dtype=layout.dtype)
    assert chunk.nbytes == layout.chunk_nbytes(CHUNK)
    gather(layout, caches, ids, chunk)
    assert torch.equal(chunk, torch.stack([c[ids] for c in caches]))
    back = [torch.zeros_like(c) for c in caches]
    scatter(layout, back, ids[1:], chunk, first_block=1)
    for c, b in zip(caches, back, strict=True):
        assert torch.equal(c[ids[1:]], b[ids[1:]]) and not b[ids[0]].any()


def test_chunk_payload_layout_is_the_documented_one(client: Client) -> None:
    layout = LAYOUTS["blocks_first"]
    caches = make_caches(layout, 8, seed=3)
    ids = torch.tensor([5, 1, 2, 7])
    chunk = torch.empty(layout.chunk_shape(CHUNK), dtype=layout.dtype)
    gather(layout, caches, ids, chunk)
    # [layers, 2, tokens, heads, dim]: token t of the chunk is block ids[t // B], slot t % B
    for layer in range(layout.num_layers):
        for kv in (0, 1):
            for t in range(CHUNK):
                assert torch.equal(chunk[layer, kv, t], caches[layer][ids[t // BLOCK], kv,
                                                                      t % BLOCK])
    back = [torch.zeros_like(c) for c in caches]
    scatter(layout, back, ids, chunk)
    for c, b in zip(caches, back, strict=True):
        assert torch.equal(c[ids], b[ids])


@pytest.mark.parametrize("kind", list(BHNC_ORDER))
def test_a_bhnc_chunk_holds_each_tokens_k_then_v_in_the_documented_order(kind: str) -> None:
    layout = LAYOUTS[kind]
    caches = make_caches(layout, 8, seed=4, kind=kind)
    ids = torch.tensor([6, 0, 3, 5])
    chunk = torch.empty(layout.chunk_shape(CHUNK), dtype=layout.dtype)
    gather(layout, caches, ids, chunk)
    d = layout.head_dim
    for layer in range(layout.num_layers):
        for kv in (0, 1):  # a token's content: K in [0, D), V in [D, 2D), per head
            for t in range(CHUNK):
                want = caches[layer][ids[t // BLOCK], :, t % BLOCK, kv * d:(kv + 1) * d]
                assert torch.equal(chunk[layer, kv, t], want)
    back = make_caches(layout, 8, seed=5, kind=kind)
    scatter(layout, back, ids, chunk)
    for c, b in zip(caches, back, strict=True):
        assert torch.equal(c[ids], b[ids])


@pytest.mark.parametrize("kind", list(BHNC_ORDER))
def test_a_bhnc_gather_into_the_slots_scratch_allocates_no_temporary(kind: str) -> None:
    """With a slot's scratch (what the connector passes), the gather reads each layer's
    blocks into it, not into a new tensor, and the chunk is the same as without it."""
    from kvpool.gpu.paged import gather_scratch_shape

    layout = LAYOUTS[kind]
    caches = make_caches(layout, 8, seed=6, kind=kind)
    ids = torch.tensor([5, 2, 7, 1])
    plain = torch.empty(layout.chunk_shape(CHUNK), dtype=layout.dtype)
    gather(layout, caches, ids, plain)
    scratch = torch.full(gather_scratch_shape(layout, CHUNK), -1, dtype=layout.dtype)
    staged = torch.empty_like(plain)
    gather(layout, caches, ids, staged, scratch=scratch)
    assert torch.equal(staged, plain)
    # the scratch holds the last layer's blocks: the gather wrote through it
    last = caches[-1].view(*caches[-1].shape[:3], 2, layout.head_dim)
    assert torch.equal(scratch, last[ids])


def test_a_prompt_sharing_a_prefix_loads_exactly_the_shared_chunks(client: Client) -> None:
    layout = LAYOUTS["flash"]
    ns = layout.namespace(f"prefix-{os.urandom(4).hex()}", chunk_tokens=CHUNK)
    caches = make_caches(layout, 64, seed=4)
    first = list(range(5 * CHUNK))
    with PagedKVConnector(client, layout, caches, ns) as conn:
        assert conn.store(first, list(range(20))) == 5 * CHUNK
        other = [*first[: 2 * CHUNK], 9, *first[2 * CHUNK + 1:]]
        assert conn.load(other, list(range(20, 40))) == 2 * CHUNK
        assert conn.load(first, list(range(20, 40)), max_tokens=5 * CHUNK - 1) == 4 * CHUNK
        assert conn.load([1, 2, 3], list(range(20, 40))) == 0  # no full chunk


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_a_corrupt_or_missing_chunk_ends_the_load_at_the_previous_one(
        client: Client, node: NodeProcess, direct: bool) -> None:
    layout = LAYOUTS["flash"]
    ns = layout.namespace(f"corrupt-{os.urandom(4).hex()}", chunk_tokens=CHUNK)
    caches = make_caches(layout, 64, seed=5)
    tokens = list(range(6 * CHUNK))
    with PagedKVConnector(client, layout, caches, ns, staging_slots=2) as conn:
        conn.store(tokens, list(range(24)))
        keys = conn._async.hasher.keys(tokens)
        # chunk 3 replaced by a valid envelope of the wrong size, chunk 4 deleted
        client.put(keys[3], b"\0" * 100)
        dst = make_caches(layout, 64, seed=6)
        before = [c.clone() for c in dst]
        with PagedKVConnector(client, layout, dst, ns, staging_slots=2, direct=direct) as b:
            assert b.load(tokens, list(range(24, 48))) == 3 * CHUNK
            assert b.stats.load_misses == 1
        if not direct:  # staged: a chunk that fails is never scattered into the blocks
            blocks_of_chunk3 = list(range(24 + 12, 24 + 16))
            for c, was in zip(dst, before, strict=True):
                assert torch.equal(c[:, blocks_of_chunk3], was[:, blocks_of_chunk3])
        put_corrupt(node, keys[3], os.urandom(layout.chunk_nbytes(CHUNK)), flip=777)
        assert conn.load(tokens, list(range(24, 48))) == 3 * CHUNK  # fails its checksum
        assert client.async_client.num_corrupt == 1
        client.put(keys[2], b"\1" * (layout.chunk_nbytes(CHUNK) + 1))  # too big for a slot
        assert conn.load(tokens, list(range(24, 48))) == 2 * CHUNK
        client.delete(keys[1])
        assert conn.load(tokens, list(range(24, 48))) == CHUNK  # lookup stops at chunk 1


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "received"])
def test_a_staged_load_writes_its_chunks_batch_by_batch_and_stops_at_a_miss(
        client: Client, monkeypatch: pytest.MonkeyPatch, in_place: bool) -> None:
    """Canonical cpu_attn chunks read in place or received are copied into a write batch
    (2 chunks here) and written a batch at a time: the same bytes as chunk by chunk, the
    first chunk's held blocks left alone, and nothing of a chunk past a miss written."""
    from kvpool.gpu import in_place as in_place_module

    monkeypatch.setattr(in_place_module, "BATCH_CHUNKS", 2)
    layout = LAYOUTS["cpu_attn"]
    ns = layout.namespace(f"batch-{os.urandom(4).hex()}", chunk_tokens=CHUNK)
    tokens = list(range(7 * CHUNK))
    src = make_caches(layout, 28, seed=7)
    with PagedKVConnector(client, layout, src, ns) as a:
        assert a.store(tokens, list(range(28))) == 7 * CHUNK
        keys = a._async.hasher.keys(tokens)
    dst_blocks = list(range(55, 27, -1))

    def loaded_of(missing: int | None) -> int:
        return 7 if missing is None else missing

    for missing in (None, 5):
        if missing is not None:  # a value of another size: a miss, read in place or not
            client.put(keys[missing], b"\0" * 100)
        dst = make_caches(layout, 56, seed=8)
        before = [c.clone() for c in dst]
        with PagedKVConnector(client, layout, dst, ns, in_place=in_place) as b:
            got = b.load(tokens, dst_blocks, skip_tokens=BLOCK)
            batch = b._async.batch
            assert batch is not None and batch.chunks == 2
            assert b.stats.chunks_in_place == (loaded_of(missing) if in_place else 0)
        loaded = loaded_of(missing)
        assert got == loaded * CHUNK
        want = token_rows(layout, src, list(range(28)), loaded * CHUNK)
        have = token_rows(layout, dst, dst_blocks, 7 * CHUNK)
        kept = token_rows(layout, before, dst_blocks, 7 * CHUNK)
        assert torch.equal(have[BLOCK:loaded * CHUNK].view(torch.uint8),
                           want[BLOCK:].view(torch.uint8))
        assert torch.equal(have[:BLOCK].view(torch.uint8), kept[:BLOCK].view(torch.uint8))
        assert torch.equal(have[loaded * CHUNK:].view(torch.uint8),
                           kept[loaded * CHUNK:].view(torch.uint8))


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "received"])
def test_loads_and_a_store_at_once_on_one_connector_take_turns(
        node: NodeProcess, in_place: bool) -> None:
    """Several loads and a store awaited together on one async connector (one staging
    slot): each prompt's blocks get its own chunks. Before they took turns, received
    loads wrote each other's chunks."""
    import asyncio

    from kvpool.client import AsyncClient
    from kvpool.gpu.connector import AsyncPagedKVConnector

    layout = LAYOUTS["cpu_attn"]
    ns = layout.namespace(f"turns-{os.urandom(4).hex()}", chunk_tokens=CHUNK)
    prompts = [list(range(p * 1000, p * 1000 + 4 * CHUNK)) for p in range(5)]
    blocks = [list(range(p * 16, p * 16 + 16)) for p in range(5)]
    src = make_caches(layout, 80, seed=1)
    dst = make_caches(layout, 80, seed=2)

    async def run() -> list[int]:
        async with AsyncClient(node.url) as client:
            a = AsyncPagedKVConnector(client, layout, src, ns, staging_slots=1)
            b = AsyncPagedKVConnector(client, layout, dst, ns, staging_slots=1,
                                      in_place=in_place)
            try:
                for p in range(4):
                    await a.store(prompts[p], blocks[p])
                return await asyncio.gather(a.store(prompts[4], blocks[4]),
                                            *[b.load(prompts[p], blocks[p]) for p in range(4)])
            finally:
                a.close()
                b.close()

    assert asyncio.run(run()) == [4 * CHUNK] * 5
    for p in range(4):
        want = token_rows(layout, src, blocks[p], 4 * CHUNK)
        got = token_rows(layout, dst, blocks[p], 4 * CHUNK)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), p


def test_layout_errors_are_clear() -> None:
    layout = LAYOUTS["flash"]
    good = make_caches(layout, 8, seed=0)
    with pytest.raises(LayoutError, match="expected 3 layer tensors"):
        layout.check(good[:2])
    with pytest.raises(LayoutError, match="layer 1: dtype"):
        layout.check([good[0], good[1].half(), good[2]])
    with pytest.raises(LayoutError, match="layer 2: shape"):
        layout.check([good[0], good[1], torch.zeros(2, 8, BLOCK, 2, 9)])
    with pytest.raises(LayoutError, match="not dense"):
        layout.check([good[0], good[1], torch.zeros(2, 8, BLOCK, 8, 2).transpose(3, 4)])
    with pytest.raises(LayoutError, match="multiple of the engine's block size"):
        layout.namespace("m", chunk_tokens=CHUNK + 1)
    stacked = torch.stack(good)  # one tensor with the layers first is accepted
    assert [t.data_ptr() for t in layout.check(stacked)] == \
        [t.data_ptr() for t in stacked.unbind(0)]
    with pytest.raises(LayoutError, match="num_kv_heads=1"):
        KVLayout(2, 2, 8, torch.float16, 4, kind="mla")
    other = KVLayout(3, 2, 8, torch.float16, BLOCK).namespace("m", chunk_tokens=CHUNK)
    with pytest.raises(LayoutError, match="does not match"):
        layout.check_namespace(other)
    assert LAYOUTS["mla"].namespace("m", chunk_tokens=CHUNK).kv_format == "mla"
    engine, canonical = (LAYOUTS[k].namespace("m", chunk_tokens=CHUNK)
                         for k in ("cpu_attn_engine", "cpu_attn"))
    assert engine.kv_format == f"cpu_attn-block{BLOCK}" and canonical.kv_format is None
    assert engine.digest != canonical.digest  # the two formats never share a key
    with pytest.raises(LayoutError, match="does not match"):
        LAYOUTS["cpu_attn_engine"].check_namespace(canonical)
    with pytest.raises(LayoutError, match="cpu_attn kind"):
        KVLayout(3, 2, 8, torch.float16, BLOCK, kind="flash", chunk_format="engine")
    assert LAYOUTS["mla"].namespace("m", chunk_tokens=CHUNK).digest != \
        KVLayout(3, 1, 24, torch.float16, BLOCK).namespace("m", chunk_tokens=CHUNK).digest
    # bhnc views may have any strides, but two elements never share memory
    bhnc = LAYOUTS["bhnc_lbnhc"]
    bhnc.check(make_caches(bhnc, 8, seed=0, kind="bhnc_lbnhc"))
    aliased = torch.zeros(8, 2, 1, 16, dtype=torch.bfloat16).expand(8, 2, BLOCK, 16)
    with pytest.raises(LayoutError, match="share memory"):
        bhnc.check([aliased] * 3)
    # canonical chunks are the same whatever the engine's kind: the keys are too
    assert bhnc.namespace("m", chunk_tokens=CHUNK) == \
        KVLayout(3, 2, 8, torch.bfloat16, BLOCK, kind="flash").namespace("m", chunk_tokens=CHUNK)


def test_load_and_store_against_a_cluster(tmp_path: object) -> None:
    """The connector routes through the cluster client: chunks spread over the owners."""
    from pathlib import Path

    from kvpool.cli.local_cluster import LocalCluster

    layout = LAYOUTS["flash"]
    ns = layout.namespace(f"cluster-{os.urandom(4).hex()}", chunk_tokens=CHUNK)
    tokens = list(range(12 * CHUNK))
    src = make_caches(layout, 64, seed=7)
    with LocalCluster(3, replication=1, data_dir=Path(str(tmp_path)),
                      serve_args=["--no-ssd", "--dram-capacity", "64MiB"]) as cluster, \
            Client(cluster.seeds) as kv:
        with PagedKVConnector(kv, layout, src, ns) as a:
            assert a.store(tokens, list(range(48))) == 12 * CHUNK
        per_node = [n["num_objects"] for n in kv.stats()["nodes"].values()]
        assert sum(per_node) == 12 and max(per_node) < 12  # spread over the owners
        dst = make_caches(layout, 64, seed=8)
        with PagedKVConnector(kv, layout, dst, ns, direct=False) as b:
            assert b.load(tokens, list(range(16, 64))) == 12 * CHUNK
        assert torch.equal(token_rows(layout, dst, list(range(16, 64)), 12 * CHUNK),
                           token_rows(layout, src, list(range(48)), 12 * CHUNK))


def test_canonical_chunks_move_between_vec_and_amx_blocks(client: Client) -> None:
    """vLLM CPU's vec kernels (K transposed) and its AMX kernels (K and V in tiles) hold
    the same tokens differently; a chunk stored from one loads into the other. The
    packing itself is checked against vLLM's own cache write in tests/gpu/test_vllm.py."""
    block, chunk = 16, 32
    vec = KVLayout(2, 2, 32, torch.bfloat16, block, kind="cpu_attn")
    amx = KVLayout(2, 2, 32, torch.bfloat16, block, kind="cpu_attn_amx")
    ns = vec.namespace(f"amx-{os.urandom(4).hex()}", chunk_tokens=chunk)
    assert amx.namespace(ns.model, chunk_tokens=chunk) == ns  # canonical: one namespace
    tokens = list(range(2 * chunk))
    src = make_caches(vec, 8, seed=9)
    with PagedKVConnector(client, vec, src, ns) as a:
        assert a.store(tokens, [5, 1, 7, 0]) == 2 * chunk
    dst = [torch.zeros(amx.layer_shape(8), dtype=amx.dtype) for _ in range(2)]
    with PagedKVConnector(client, amx, dst, ns) as b:
        assert b.load(tokens, [2, 3, 6, 4]) == 2 * chunk
    for layer in range(2):
        for (s_blk, d_blk) in zip([5, 1, 7, 0], [2, 3, 6, 4], strict=True):
            d = 32
            s_flat, d_flat = src[layer][s_blk].view(2, -1), dst[layer][d_blk].view(2, -1)
            k_src = s_flat[:, : block * d].view(2, d, block).transpose(1, 2)  # [h, t, d]
            v_src = s_flat[:, block * d :].view(2, block, d)
            # AMX: K[t, d] at [t//16, d//2, t%16, d%2]; V[t, d] at [d//16, t//2, d%16, t%2]
            k_dst = d_flat[:, : block * d].view(2, block // 16, d // 2, 16, 2)
            k_dst = k_dst.permute(0, 1, 3, 2, 4).reshape(2, block, d)
            v_dst = d_flat[:, block * d :].view(2, d // 16, block // 2, 16, 2)
            v_dst = v_dst.permute(0, 2, 4, 1, 3).reshape(2, block, d)
            assert torch.equal(k_src, k_dst) and torch.equal(v_src, v_dst)
    with pytest.raises(LayoutError, match="multiples of 16"):
        KVLayout(2, 2, 32, torch.bfloat16, 8, kind="cpu_attn_amx")
    with pytest.raises(LayoutError, match="2-byte elements"):
        KVLayout(2, 2, 32, torch.float32, block, kind="cpu_attn_amx")


@pytest.mark.parametrize(("kind", "chunk_format"), [
    ("cpu_attn", "canonical"), ("cpu_attn_amx", "canonical"), ("cpu_attn", "engine"),
    ("cpu_attn_amx", "engine")])
def test_the_scatter_with_views_made_once_writes_what_scatter_writes(
        kind: LayoutKind, chunk_format: ChunkFormat) -> None:
    layout = KVLayout(3, 2, 32, torch.bfloat16, 16, kind=kind, chunk_format=chunk_format)
    g = torch.Generator().manual_seed(9)
    chunk = torch.randn(layout.chunk_shape(32), generator=g).to(layout.dtype)  # 2 blocks
    want = make_caches(layout, 8, seed=3)
    got = [c.clone() for c in want]
    ids = torch.tensor([5, 2])
    scatter(layout, want, ids, chunk)
    scatter(layout, want, ids[1:], chunk, first_block=1)
    fast = CpuAttnScatter(layout, got)
    fast(layout, got, ids, chunk)
    fast(layout, got, ids[1:], chunk, first_block=1)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(want, got, strict=True))
    # other caches than its own: the plain scatter, into those
    other = make_caches(layout, 8, seed=4)
    expected = [c.clone() for c in other]
    scatter(layout, expected, ids, chunk)
    fast(layout, other, ids, chunk)
    assert all(torch.equal(a, b) for a, b in zip(expected, other, strict=True))
    # another layout (the other chunk format) into its own caches: the plain scatter too
    twin = KVLayout(3, 2, 32, torch.bfloat16, 16, kind=kind,
                    chunk_format="engine" if chunk_format == "canonical" else "canonical")
    twin_chunk = torch.randn(twin.chunk_shape(32), generator=g).to(twin.dtype)
    expected = [c.clone() for c in got]
    scatter(twin, expected, ids, twin_chunk)
    fast(twin, got, ids, twin_chunk)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(expected, got, strict=True))


def test_a_pipeline_stage_keys_its_own_layers_apart() -> None:
    """A layout of a pipeline stage names its layer range in the namespace's kv_format, so
    two stages (same layer count, same geometry) never share a key; a range that does not
    match the layer count is refused."""
    from kvpool.placement.keys import ChunkHasher

    first = KVLayout(3, 2, 8, torch.bfloat16, BLOCK, kind="bhnc", layer_range=(0, 3))
    second = KVLayout(3, 2, 8, torch.bfloat16, BLOCK, kind="bhnc", layer_range=(3, 6))
    engine = KVLayout(3, 2, 8, torch.bfloat16, BLOCK, kind="cpu_attn", chunk_format="engine",
                      layer_range=(3, 6))
    assert (first.kv_format, second.kv_format) == ("layers0-3", "layers3-6")
    assert engine.kv_format == "cpu_attn-block4-layers3-6"
    tokens = list(range(CHUNK))
    keys = {ChunkHasher(layout.namespace("m", chunk_tokens=CHUNK)).keys(tokens)[0]
            for layout in (first, second, engine, LAYOUTS["bhnc_lbnhc"])}
    assert len(keys) == 4
    with pytest.raises(LayoutError, match="layer_range"):
        KVLayout(3, 2, 8, torch.bfloat16, BLOCK, kind="bhnc", layer_range=(0, 4))
