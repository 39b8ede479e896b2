"""SGLang's HiCache through kvpool: the backend's batch calls vs the SDK's on the same pages.

    python -m bench.sglang [--rounds 7] [--python $VLLM_CPU_PYTHON]

One kvpool node (DRAM only) on 127.0.0.1; the measurement runs in the engines'
environment (a python with ``sglang==0.5.23`` and kvpool: ``.ci/run`` makes it). A
host pool of SGLang's ``page_first`` layout (:class:`HostPool`; SmolLM2-135M's
geometry: 30 layers, 3 KV heads of 64, bf16; pages of 64 tokens, 1.47 MB each) and
one batch of 128 pages (SGLang's ``STORAGE_BATCH_SIZE``) a call, in rounds that
alternate the two sides:

- set: ``batch_set_v1`` of 128 new pages (its exists pre-pass finds none) against
  ``Client.put_many`` of the same pages, sent from the same places in the pool;
- get: ``batch_get_v1`` of the pages the backend stored, into the pool, against
  ``Client.get_many_into`` of the same stored values into the same places;
- exists: ``batch_exists`` of the 128 keys against ``Client.lookup``, 20 calls a side
  alternated call by call, the median of each side's last 19 a round.

GB/s (set, get) and ms (exists), median [min-max] over the rounds, and the
backend/SDK ratio paired by round. Written to ``bench/results/sglang.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from bench._procs import run_json, start_node
from bench._stats import fmt, save, summary

PAGES = 128  # SGLang's STORAGE_BATCH_SIZE: the pages of one batch call


class HostPool:
    """A stand-in for SGLang's MHA host pool (``MHATokenToKVPoolHost``, whose module does
    not import beside vLLM: it pulls in torchvision through SGLang's model configs):
    the buffer shapes and page addressing of sglang 0.5.23's ``pool_host/mha.py`` for
    the ``layer_first``, ``page_first`` and ``page_first_direct`` layouts
    (``init_kv_buffer``, ``get_page_buffer_meta``, ``get_data_page``,
    ``get_dummy_flat_data_page``), in plain memory. Used by this benchmark and by
    ``tests/sglang_driver.py``."""

    def __init__(self, layout: str, page_size: int, pages: int, *, layers: int = 4,
                 heads: int = 2, dim: int = 16) -> None:
        import torch

        self.layout, self.page_size, self.dtype = layout, page_size, torch.bfloat16
        self.layer_num, self.head_num, self.head_dim = layers, heads, dim
        self.page_num, self.size = pages, pages * page_size
        if layout == "layer_first":
            dims: tuple[int, ...] = (2, layers, self.size, heads, dim)
        elif layout == "page_first":
            dims = (2, self.size, layers, heads, dim)
        elif layout == "page_first_direct":
            dims = (2, pages, layers, page_size, heads, dim)
        else:
            raise ValueError(f"Unsupported layout: {layout}")
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        """Pointers and sizes of each page's K and V (per layer for layer_first)."""
        assert len(indices) % self.page_size == 0
        token = self.head_num * self.head_dim * self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        v_offset = self.layer_num * self.size * token
        ptrs: list[int] = []
        firsts = indices.tolist()[:: self.page_size]
        if self.layout == "layer_first":
            for first in firsts:
                for layer in range(self.layer_num):
                    k = base + first * token + layer * self.size * token
                    ptrs += [k, k + v_offset]
            return ptrs, [self.page_size * token] * len(ptrs)
        for first in firsts:
            k = base + first * self.layer_num * token
            ptrs += [k, k + v_offset]
        return ptrs, [self.layer_num * self.page_size * token] * len(ptrs)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index : index + self.page_size]
        else:
            real = index // self.page_size
            page = self.kv_buffer[:, real : real + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> Any:
        import torch

        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()


def measure(url: str, rounds: int) -> dict[str, Any]:
    """In the engines' environment: the backend and the SDK, alternated by round."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from kvpool.client import Client

    page_size = 64
    pool = HostPool("page_first", page_size, PAGES, layers=30, heads=3, dim=64)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=True,
        model_name=f"bench-{os.urandom(4).hex()}", extra_config={
            "backend_name": "kvpool", "module_path": "kvpool.gpu.sglang",
            "class_name": "KvpoolHiCacheStorage", "interface_v1": 1, "kvpool_url": url})
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    indices = torch.arange(PAGES * page_size)
    nbytes = PAGES * backend._page_bytes
    out: dict[str, list[float]] = {name: [] for name in (
        "set backend", "set sdk", "get backend", "get sdk", "exists backend", "exists sdk")}
    with Client(url) as client:
        for r in range(rounds):
            keys = [f"r{r}-p{i}" for i in range(PAGES)]
            sdk_keys = [backend.key(f"sdk-{k}") for k in keys]
            pages = backend._segments(indices, PAGES)
            for side in (("backend", "sdk") if r % 2 == 0 else ("sdk", "backend")):
                t0 = time.perf_counter()
                if side == "backend":
                    assert all(backend.batch_set_v1(keys, indices))
                else:
                    client.put_many(sdk_keys, pages, num_tokens=page_size)
                out[f"set {side}"].append(nbytes / (time.perf_counter() - t0) / 1e9)
            # both sides read the pages the backend stored: the same values, where they lie
            same = [backend.key(k) for k in keys]
            for side in (("backend", "sdk") if r % 2 == 0 else ("sdk", "backend")):
                t0 = time.perf_counter()
                if side == "backend":
                    assert all(backend.batch_get_v1(keys, indices))
                else:
                    assert client.get_many_into(same, pages) == [backend._page_bytes] * PAGES
                out[f"get {side}"].append(nbytes / (time.perf_counter() - t0) / 1e9)
            # lookups: 20 a side, alternated call by call (each side's first call after
            # its get would also report that get's reads through the arena index)
            times: dict[str, list[float]] = {"backend": [], "sdk": []}
            for i in range(40):
                side = "backend" if (i + r) % 2 == 0 else "sdk"
                t0 = time.perf_counter()
                if side == "backend":
                    assert backend.batch_exists(keys) == PAGES
                else:
                    assert client.lookup(sdk_keys) == PAGES
                times[side].append((time.perf_counter() - t0) * 1e3)
            for side, values in times.items():
                out[f"exists {side}"].append(statistics.median(values[1:]))
    backend.close()
    results = {name: summary(v) for name, v in out.items()}
    ratios = {op: summary([a / b for a, b in zip(out[f"{op} backend"], out[f"{op} sdk"],
                                                   strict=True)])
              for op in ("set", "get", "exists")}
    return {"page_bytes": backend._page_bytes, "pages": PAGES, "rounds": rounds,
            "results": results, "backend_over_sdk": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--python", default=os.environ.get("VLLM_CPU_PYTHON", ""),
                        help="a python with sglang==0.5.23 and kvpool (default "
                             "$VLLM_CPU_PYTHON)")
    parser.add_argument("--measure", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the measurement alone, in the engines' environment
        print(json.dumps(measure(args.measure, args.rounds)))
        return 0
    if not args.python:
        print("give --python or $VLLM_CPU_PYTHON (a python with sglang==0.5.23 and kvpool; "
              ".ci/run makes one)", file=sys.stderr)
        return 2
    node = start_node("--dram-capacity", "4GiB", "--no-ssd")
    try:
        result = run_json(args.python, "bench.sglang", "--measure", node.url,
                          "--rounds", str(args.rounds))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        node.stop()
    res, ratio = result["results"], result["backend_over_sdk"]
    print(f"\nSGLang HiCache backend vs kvpool's SDK, {result['pages']} pages of "
          f"{result['page_bytes'] / 1e6:.2f} MB a call, {result['rounds']} rounds, median "
          "[min-max]\n")
    print("| call | backend | SDK | backend / SDK, paired |")
    print("|---|---|---|---|")
    for op, unit in (("set", "GB/s"), ("get", "GB/s"), ("exists", "ms")):
        print(f"| {op} ({unit}) | {fmt(res[f'{op} backend'])} | {fmt(res[f'{op} sdk'])} "
              f"| {fmt(ratio[op])} |")
    print(f"written to {save('sglang', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
