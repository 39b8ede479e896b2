"""SGLang's HiCache through kvpool: the backend's batch calls vs the SDK's on the same pages.

    python -m bench.sglang [--rounds 7] [--python $VLLM_CPU_PYTHON]

One kvpool node (DRAM only) on 127.0.0.1; the measurement runs in the engines'
environment (a python with ``sglang==0.5.23`` and kvpool: ``.ci/run`` makes it). A
host pool of SGLang's ``page_first`` layout (SGLang's own, :func:`host_pool`; SmolLM2-135M's
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
import importlib.abc
import importlib.machinery
import json
import os
import statistics
import sys
import time
import types
from typing import Any

from bench._procs import run_json, start_node
from bench._stats import fmt, save, summary

PAGES = 128  # SGLang's STORAGE_BATCH_SIZE: the pages of one batch call


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for ``torchvision`` and ``gguf``, which SGLang's model configs import
    at module level (its host pool module pulls them in) and this environment lacks:
    PyPI's torchvision is a CUDA build that replaces vLLM's torch. Nothing in the host
    pool uses them. Installed after transformers has found them absent, so it never uses
    them either."""

    roots = ("torchvision", "gguf")

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".", maxsplit=1)[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: Any) -> Any:
        return _stand_in(spec.name)

    def exec_module(self, module: Any) -> None:
        module.__path__ = []


class _StandIn(types.ModuleType):
    """An empty module whose every attribute is another stand-in."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        sub = _stand_in(f"{self.__name__}.{attr}")
        setattr(self, attr, sub)
        return sub


def _stand_in(name: str) -> Any:
    module = _StandIn(name)
    module.__path__ = []
    return module


def host_pool(layout: str, page_size: int, pages: int, *, layers: int = 4, heads: int = 2,
              dim: int = 16) -> Any:
    """SGLang's own MHA host pool (``MHATokenToKVPoolHost``, bf16, plain memory) of at
    least ``pages`` pages of ``page_size`` tokens, built on the CPU over SGLang's device
    pool as SGLang's own storage tests build it (``layout``: ``layer_first``,
    ``page_first`` or ``page_first_direct``)."""
    import sys

    if not any(isinstance(f, _StandIns) for f in sys.meta_path):
        import transformers.utils.import_utils  # noqa: F401 (decides torchvision is absent)

        sys.meta_path.insert(0, _StandIns())
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool((pages + 1) // 2 * page_size, page_size, torch.bfloat16, heads,
                              dim, layers, "cpu", False, start_layer=0, end_layer=layers)
    with host_memory_budget_scope(1 << 40):  # (the pool is sized here, not by free memory)
        return MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 2, 0, page_size, layout,
            pin_memory=False, device_capacity_tokens=device.size,
            start_layer=device.start_layer, end_layer=device.end_layer,
            write_back_staging=device.hicache_write_back_staging)


def measure(url: str, rounds: int) -> dict[str, Any]:
    """In the engines' environment: the backend and the SDK, alternated by round."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from kvpool.client import Client

    page_size = 64
    pool = host_pool("page_first", page_size, PAGES, layers=30, heads=3, dim=64)
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
