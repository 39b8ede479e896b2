"""LMCache's remote tier through kvpool, vs kvpool's SDK and vs LMCache's own server.

    python -m bench.lmcache [--rounds 7] [--python $VLLM_CPU_PYTHON]

One kvpool node (DRAM only) and LMCache's own cache server (``python -m
lmcache.v1.server``, CPU) on 127.0.0.1; the measurement runs in the engines'
environment (a python with ``lmcache==0.5.6`` and kvpool: ``.ci/run`` makes it).
LMCache's own parts make the chunks (``LocalCPUBackend``'s allocator; SmolLM2-135M's
geometry, 256-token chunks of 5.9 MB, bf16) and the connectors (``CreateConnector``;
their coroutines on a loop of their own thread, as LMCache runs them). Each round
moves 32 new chunks with each of, in an order that rotates by round:

- ``kvpool plugin``: ``plugin://kvpool`` (this package's plugin) ``batched_put`` /
  ``batched_get``;
- ``kvpool SDK``: ``AsyncClient.put_many`` of the same bytes (header and data, from
  the same MemoryObjs) under keys of its own, and ``get_many_into`` of the chunks the
  plugin stored (the same values) into the same MemoryObjs;
- ``LMCache server``: ``lm://`` (LMCache's connector to its server), ``put`` / ``get``
  of one chunk after another (it has no batched calls).

GB/s median [min-max] over the rounds, ratios paired by round. Written to
``bench/results/lmcache.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from typing import Any

from bench._procs import run_json, start_lmcache, start_node
from bench._stats import fmt, save, summary

CHUNKS = 32
SIDES = ("kvpool plugin", "kvpool SDK", "LMCache server")


def measure(url: str, lm_url: str, rounds: int) -> dict[str, Any]:
    """In the engines' environment: the three sides, rotated by round."""
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    from kvpool.gpu.lmcache import chunk_key

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=True, max_local_cpu_size=1.0,
        remote_storage_plugins=["kvpool"], extra_config={
            "remote_storage_plugin.kvpool.module_path": "kvpool.gpu.lmcache",
            "remote_storage_plugin.kvpool.class_name": "KvpoolConnectorAdapter",
            "remote_storage_plugin.kvpool.url": url})
    model = f"bench-{os.urandom(4).hex()}"
    metadata = LMCacheMetadata(model_name=model, world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                               kv_shape=(30, 2, 256, 3, 64), chunk_size=256)
    backend = LocalCPUBackend(config, metadata, dst_device="cpu")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(300)

    plugin = CreateConnector("plugin://kvpool", loop, backend, config, metadata,
                             plugin_name="kvpool")
    server = CreateConnector(lm_url, loop, backend, config, metadata)
    sdk = call(_client(url))
    inner = plugin._connector
    head_bytes = inner.remote_metadata_bytes
    objs = [backend.allocate(metadata.get_shapes(), metadata.get_dtypes(), None)
            for _ in range(CHUNKS)]
    for obj in objs:
        obj.tensor.copy_(torch.randn(obj.tensor.shape).to(obj.tensor.dtype))
        obj.ref_count_up()  # kept across rounds: the connectors' puts release one each
    nbytes = sum(len(memoryview(o.byte_array).cast("B")) for o in objs)
    heads = [bytearray(head_bytes) for _ in objs]
    out: dict[str, dict[str, list[float]]] = {op: {s: [] for s in SIDES}
                                              for op in ("put", "get")}
    for r in range(rounds):
        keys = {side: [CacheEngineKey(model, 1, 0, r * 1000 + 100 * i + c, torch.bfloat16)
                       for c in range(CHUNKS)] for i, side in enumerate(SIDES)}
        order = SIDES[r % 3:] + SIDES[: r % 3]
        for side in order:
            for obj in objs:
                obj.ref_count_up()  # what the put releases
            t0 = time.perf_counter()
            if side == "kvpool SDK":
                call(sdk.put_many([chunk_key(k) for k in keys[side]],
                                  [[h, memoryview(o.byte_array).cast("B")]
                                   for h, o in zip(heads, objs, strict=True)]))
                for obj in objs:
                    obj.ref_count_down()
            elif side == "kvpool plugin":
                call(plugin.batched_put(keys[side], objs))
            else:  # LMCache's server connector has no batched calls: one chunk at a time
                call(_each(server.put, keys[side], objs))
            out["put"][side].append(nbytes / (time.perf_counter() - t0) / 1e9)
        for side in order:
            t0 = time.perf_counter()
            if side == "kvpool SDK":  # the chunks the plugin stored: the same values
                got = call(sdk.get_many_into([chunk_key(k) for k in keys["kvpool plugin"]],
                                             [[h, memoryview(o.byte_array).cast("B")]
                                              for h, o in zip(heads, objs, strict=True)]))
                assert all(n is not None for n in got), got
            else:
                back = call(plugin.batched_get(keys[side]) if side == "kvpool plugin"
                            else _each(server.get, keys[side]))
                assert all(b is not None for b in back), side
            out["get"][side].append(nbytes / (time.perf_counter() - t0) / 1e9)
            if side != "kvpool SDK":
                for b in back:
                    b.ref_count_down()
    call(sdk.close())
    call(plugin.close())
    call(server.close())
    loop.call_soon_threadsafe(loop.stop)
    ratios = {op: {"plugin / SDK": summary([a / b for a, b in zip(
                       out[op]["kvpool plugin"], out[op]["kvpool SDK"], strict=True)]),
                   "plugin / LMCache server": summary([a / b for a, b in zip(
                       out[op]["kvpool plugin"], out[op]["LMCache server"], strict=True)])}
              for op in out}
    return {"chunk_bytes": nbytes // CHUNKS, "chunks": CHUNKS, "rounds": rounds,
            "gb_s": {op: {s: summary(v) for s, v in sides.items()}
                     for op, sides in out.items()}, "ratios": ratios}


async def _each(fn: Any, keys: list[Any], objs: list[Any] | None = None) -> list[Any]:
    """``fn`` of each key (and object) in turn."""
    if objs is None:
        return [await fn(k) for k in keys]
    return [await fn(k, o) for k, o in zip(keys, objs, strict=True)]


async def _client(url: str) -> Any:
    from kvpool.client import AsyncClient

    client = AsyncClient(url)
    await client.connect()
    return client


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--python", default=os.environ.get("VLLM_CPU_PYTHON", ""),
                        help="a python with lmcache==0.5.6 and kvpool (default "
                             "$VLLM_CPU_PYTHON)")
    parser.add_argument("--measure", nargs=2, metavar=("URL", "LM_URL"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the measurement alone, in the engines' environment
        url, lm_url = args.measure
        print(json.dumps(measure(url, lm_url, args.rounds)))
        return 0
    if not args.python:
        print("give --python or $VLLM_CPU_PYTHON (a python with lmcache==0.5.6 and kvpool; "
              ".ci/run makes one)", file=sys.stderr)
        return 2
    node = start_node("--dram-capacity", "6GiB", "--no-ssd")
    lm_server = None
    try:
        lm_server = start_lmcache(args.python)
        result = run_json(args.python, "bench.lmcache", "--measure", node.url,
                          f"lm://127.0.0.1:{lm_server.port}", "--rounds", str(args.rounds),
                          timeout=1200)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        node.stop()
        if lm_server is not None:
            lm_server.stop()
    print(f"\nLMCache remote tier, {result['chunks']} chunks of "
          f"{result['chunk_bytes'] / 1e6:.2f} MB a batch, {result['rounds']} rounds, GB/s "
          "median [min-max]\n")
    print(f"| call | {' | '.join(SIDES)} | plugin / SDK | plugin / LMCache server |")
    print("|---|---|---|---|---|---|")
    for op in ("put", "get"):
        gb, ratio = result["gb_s"][op], result["ratios"][op]
        print(f"| {op} | {' | '.join(fmt(gb[s]) for s in SIDES)} "
              f"| {fmt(ratio['plugin / SDK'])} | {fmt(ratio['plugin / LMCache server'])} |")
    print(f"written to {save('lmcache', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
