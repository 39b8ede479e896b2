"""Runs kvpool's LMCache plugin inside an environment that has LMCache.

    $VLLM_CPU_PYTHON -m tests.lmcache_driver SPEC.json OUT.json

LMCache 0.5.6 (installed ``--no-deps`` beside vLLM: its CUDA dependencies do not
install here) with its own parts: an ``LMCacheEngineConfig`` naming the plugin
(``remote_storage_plugins: ["kvpool"]`` and its ``module_path``/``class_name``), an
``LMCacheMetadata``, a ``LocalCPUBackend`` whose allocator makes every ``MemoryObj``,
and the connector made by LMCache's own launcher (``CreateConnector("plugin://kvpool",
...)``, the URL LMCache's ``RemoteBackend`` asks for), whose coroutines run on an
event loop of their own thread, as LMCache runs them.

SPEC ``{"url": ..., "extra": {...}, "steps": [...]}``; each step ``{"do": ...}``:
``put`` (chunks ``chunks``, each ``[hash, tokens, seed]``: a MemoryObj of ``tokens``
tokens filled from ``seed``), ``get`` (hashes ``hashes``: per chunk null for a miss,
else its tokens and whether its bytes equal what ``seed`` makes), ``contains``
(hashes: the leading count), ``exists`` (one hash), ``kill`` (``pid``), ``put_shaped``
(one chunk ``hash`` whose MemoryObj, and so its header, has ``shape``, filled from
``seed``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
import threading
from typing import Any

LAYERS, HEADS, DIM, CHUNK = 4, 2, 8, 16


def _fill(obj: Any, seed: int) -> None:
    import torch

    tensor = obj.tensor
    tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed))
                 .to(tensor.dtype))


def _metadata() -> Any:
    """The test model's ``LMCacheMetadata``: bf16 chunks of CHUNK tokens."""
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(model_name="kvpool-test/lmcache", world_size=1, local_world_size=1,
                           worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM), chunk_size=CHUNK)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05,
        remote_storage_plugins=["kvpool"], extra_config={
            "remote_storage_plugin.kvpool.module_path": "kvpool.gpu.lmcache",
            "remote_storage_plugin.kvpool.class_name": "KvpoolConnectorAdapter",
            "remote_storage_plugin.kvpool.url": spec["url"], **spec.get("extra", {})})
    metadata = _metadata()
    backend = LocalCPUBackend(config, metadata, dst_device="cpu")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    try:
        connector = CreateConnector("plugin://kvpool", loop, backend, config, metadata,
                                    plugin_name="kvpool")
    except Exception as exc:
        return {"made": False, "error": f"{type(exc).__name__}: {exc}"}
    inner = getattr(connector, "_connector", connector)  # under LMCache's instrumentation

    def key(chunk_hash: int) -> Any:
        return CacheEngineKey("kvpool-test/lmcache", 1, 0, chunk_hash, torch.bfloat16)

    def chunk(tokens: int, seed: int) -> Any:
        shape = torch.Size([2, LAYERS, tokens, HEADS * DIM])
        obj = backend.allocate([shape], [torch.bfloat16], None)
        assert obj is not None
        _fill(obj, seed)
        return obj

    results: list[Any] = []
    for step in spec["steps"]:
        do = step["do"]
        if do == "put":
            objs = [chunk(tokens, seed) for _, tokens, seed in step["chunks"]]
            # LMCache's instrumented connector releases the objects once they are sent
            call(connector.batched_put([key(h) for h, _, _ in step["chunks"]], objs))
            result: Any = None
        elif do == "put_shaped":  # one chunk whose header names ``shape`` (same bytes)
            obj = backend.allocate([torch.Size(step["shape"])], [torch.bfloat16], None)
            assert obj is not None
            _fill(obj, step["seed"])
            call(connector.batched_put([key(step["hash"])], [obj]))
            result = None
        elif do == "get":
            got = call(connector.batched_get([key(h) for h in step["hashes"]]))
            result = []
            for obj, seed in zip(got, step["seeds"], strict=True):
                if obj is None:
                    result.append(None)
                    continue
                tokens = obj.get_shapes()[0][2]
                want = chunk(tokens, seed)
                result.append({"tokens": int(tokens), "equal": bool(torch.equal(
                    obj.tensor.view(torch.uint8), want.tensor.view(torch.uint8)))})
                want.ref_count_down()
                obj.ref_count_down()
        elif do == "contains":
            result = call(connector.batched_async_contains("t", [key(h)
                                                                 for h in step["hashes"]]))
        elif do == "exists":
            result = bool(connector.exists_sync(key(step["hash"])))
        elif do == "key":
            from kvpool.gpu.lmcache import chunk_key

            result = chunk_key(key(step["hash"])).hex()
        elif do == "kill":
            os.kill(step["pid"], signal.SIGKILL)
            result = None
        else:
            raise ValueError(f"unknown step {do!r}")
        results.append(result)
    counters = dataclasses.asdict(inner.counters) if hasattr(inner, "counters") else {}
    call(connector.close())
    loop.call_soon_threadsafe(loop.stop)
    return {"made": True, "steps": results, "counters": counters,
            "connector": type(inner).__name__}


def storage(spec: dict[str, Any]) -> dict[str, Any]:
    """LMCache's storage as vLLM's LMCache connector builds it: the config file named by
    ``LMCACHE_CONFIG_FILE`` (``spec["config_file"]``) read by LMCache's own loader, then
    ``CreateStorageBackends``. The backends made (or the error that stopped LMCache),
    LMCache's WARNING and ERROR lines (``lines``), and with ``round_trip`` a chunk put through the
    kvpool backend and read back."""
    import logging
    import time

    import torch
    from lmcache.integration.vllm.utils import lmcache_get_or_create_config
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.storage_backend import CreateStorageBackends
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    os.environ["LMCACHE_CONFIG_FILE"] = spec["config_file"]
    config = lmcache_get_or_create_config()
    metadata = _metadata()
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"{record.levelname} {record.getMessage()}")

    keep = Keep(logging.WARNING)
    for name in list(logging.root.manager.loggerDict):  # LMCache's loggers do not propagate
        if name.startswith("lmcache"):
            logging.getLogger(name).addHandler(keep)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        backends = CreateStorageBackends(config, metadata, loop, "cpu")
    except Exception as exc:
        return {"started": False, "error": f"{type(exc).__name__}: {exc}", "lines": lines}
    out: dict[str, Any] = {"started": True, "backends": list(backends), "lines": lines}
    remote = [b for b in backends.values() if isinstance(b, RemoteBackend)]
    out["connected"] = [b.connection is not None for b in remote]
    if spec.get("round_trip") and remote and remote[0].connection is not None:
        local = backends["LocalCPUBackend"]
        key = CacheEngineKey("kvpool-test/lmcache", 1, 0, 4242, torch.bfloat16)
        obj = local.allocate([torch.Size([2, LAYERS, CHUNK, HEADS * DIM])], [torch.bfloat16],
                             None)
        _fill(obj, 7)
        want = obj.tensor.clone()
        remote[0].batched_submit_put_task([key], [obj])
        for _ in range(200):  # the put runs on LMCache's loop
            if remote[0].contains(key):
                break
            time.sleep(0.05)
        got = remote[0].get_blocking(key)
        out["round_trip"] = got is not None and bool(torch.equal(
            got.tensor.view(torch.uint8), want.view(torch.uint8)))
    for backend in backends.values():
        backend.close()
    loop.call_soon_threadsafe(loop.stop)
    return out


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out = storage(spec) if spec.get("mode") == "storage" else run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
