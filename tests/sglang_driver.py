"""Runs kvpool's SGLang HiCache backend inside an environment that has SGLang.

    $VLLM_CPU_PYTHON -m tests.sglang_driver SPEC.json OUT.json

SGLang cannot serve on these machines (its kernels are CUDA builds), but its storage
layer imports with the CPU torch: the backend is made the way SGLang's cache
controller makes a ``dynamic`` backend (``StorageBackendFactory.create_backend`` with
a real ``HiCacheStorageConfig``, then ``register_mem_pool_host``).

The host pool is SGLang's own (``MHATokenToKVPoolHost`` over SGLang's device pool,
built on the CPU as SGLang's storage tests build it: ``bench.sglang.host_pool``), in
plain (not pinned) memory. Its module imports SGLang's model configs, which import
``torchvision`` and ``gguf`` at module level; neither is installed here (PyPI's
torchvision is a CUDA build that breaks ``import vllm`` in this environment), so the
driver gives those two empty stand-in modules, after transformers has decided they are
absent; nothing in the pool uses them.

SPEC: ``{"steps": [...]}``, each step a dict with ``"do"``:

- ``"backend"``: make backend ``name`` over pool ``pool`` for ``url`` (``extra``:
  more extra-config keys; ``layout``, ``page_size``, ``pages``, ``geometry``: the pool);
- ``"pool"``: make pool ``pool`` alone (``layout``, ``page_size``, ``pages``, ``geometry``);
- ``"fill"``: random bytes into every page of pool ``pool`` (seed ``seed``);
- ``"exists"``, ``"set"``, ``"get"``: batch_exists / batch_set_v1 / batch_get_v1 of
  backend ``name`` for the page keys ``keys`` at pool pages ``pages``;
- ``"get_flat"``: the copying batch_get into flat data pages;
- ``"single"``: the one-key ``set``, ``get`` and ``exists`` of page ``page``;
- ``"same"``: whether pages ``pages`` of pools ``a`` and ``b`` hold the same bytes;
- ``"kill"``: SIGKILL process ``pid`` (``after`` seconds: meanwhile the next steps
  run); ``"sleep"``: ``seconds``.

OUT: one result per step, plus each backend's counters at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from typing import Any


def host_pool(layout: str, page_size: int, pages: int, **geometry: int) -> Any:
    from bench.sglang import host_pool as sglang_host_pool

    return sglang_host_pool(layout, page_size, pages, **geometry)


def indices(pool: Any, pages: list[int]) -> Any:
    import torch

    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size)
                      for p in pages]) if pages else torch.empty(0, dtype=torch.int64)


def make_backend(url: str, pool: Any, extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=True,
        model_name="kvpool-test/sglang", extra_config={
            "backend_name": "kvpool", "module_path": "kvpool.gpu.sglang",
            "class_name": "KvpoolHiCacheStorage", "interface_v1": 1, "kvpool_url": url,
            **extra})
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)  # as the cache controller does next
    return backend


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    pools: dict[str, Any] = {}
    backends: dict[str, Any] = {}
    results: list[Any] = []
    for step in spec["steps"]:
        do = step["do"]
        started = time.perf_counter()
        if do == "backend":
            pool = pools.get(step["pool"])
            if pool is None:
                pool = pools[step["pool"]] = host_pool(
                    step.get("layout", "page_first"), step.get("page_size", 16),
                    step.get("pages", 8), **step.get("geometry", {}))
            try:
                made = make_backend(step["url"], pool, step.get("extra", {}))
                backends[step["name"]] = made
                result: Any = {"made": True, "kv_format": made.namespace.kv_format}
            except Exception as exc:
                result = {"made": False, "error": f"{type(exc).__name__}: {exc}"}
        elif do == "pool":
            pools[step["pool"]] = host_pool(step.get("layout", "page_first"),
                                            step.get("page_size", 16), step.get("pages", 8),
                                            **step.get("geometry", {}))
            result = None
        elif do == "fill":
            pool = pools[step["pool"]]
            g = torch.Generator().manual_seed(step.get("seed", 0))
            pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g))
            result = None
        elif do in ("exists", "set", "get", "get_flat"):
            backend = backends[step["name"]]
            pool = backend.mem_pool_host
            keys = step["keys"]
            if do == "exists":
                result = backend.batch_exists(keys)
            elif do == "set":
                result = backend.batch_set_v1(keys, indices(pool, step["pages"]))
            elif do == "get":
                result = backend.batch_get_v1(keys, indices(pool, step["pages"]))
            else:
                targets = [pool.get_dummy_flat_data_page() for _ in keys]
                got = backend.batch_get(keys, targets)
                result = [t is not None and bool(torch.equal(
                    t.view(torch.uint8), pool.get_data_page(p * pool.page_size).contiguous()
                    .view(torch.uint8))) for t, p in zip(got, step["pages"], strict=True)]
        elif do == "single":  # the one-key calls: set page ``page`` under ``key``, get, exists
            backend = backends[step["name"]]
            pool = backend.mem_pool_host
            page = pool.get_data_page(step["page"] * pool.page_size).contiguous()
            stored = backend.set(step["key"], page)
            target = pool.get_dummy_flat_data_page()
            got = backend.get(step["key"], target)
            result = {"set": stored, "exists": backend.exists(step["key"]),
                      "missing": backend.exists(step["key"] + "-never-stored"),
                      "get_equal": got is not None and bool(torch.equal(
                          got.view(torch.uint8), page.view(torch.uint8)))}
        elif do == "same":
            a, b = pools[step["a"]], pools[step["b"]]
            result = [bool(torch.equal(a.get_data_page(p * a.page_size).view(torch.uint8),
                                       b.get_data_page(p * b.page_size).view(torch.uint8)))
                      for p in step["pages"]]
        elif do == "kill":  # now, or ``after`` seconds (while the next steps run)
            if step.get("after"):
                threading.Timer(step["after"], os.kill, (step["pid"], signal.SIGKILL)).start()
            else:
                os.kill(step["pid"], signal.SIGKILL)
            result = None
        elif do == "sleep":
            time.sleep(step["seconds"])
            result = None
        else:
            raise ValueError(f"unknown step {do!r}")
        results.append({"do": do, "result": result,
                        "seconds": round(time.perf_counter() - started, 4)})
    counters = {}
    for name, backend in backends.items():
        fields = dataclasses.asdict(backend.counters)
        fields.pop("recent")
        counters[name] = fields
        backend.close()
    return {"steps": results, "counters": counters}


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out = run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
