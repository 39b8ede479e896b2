"""The vLLM connector's acceptance check on a GPU (issue 48): one script, under 8 minutes.

    python -m bench.gpu_accept [--backends FLASH_ATTN,FLASHINFER,TRITON_ATTN]
        [--modes async,sync,layer] [--cpu]

Needs torch with CUDA, vLLM's CUDA build and ``kvpool[server]`` installed (or
``--node-python`` naming an interpreter that has the node); nothing is downloaded:
the model is a tiny random-init Llama (4 layers, 4 heads, 2 KV heads, head dim 64, bf16)
made from a config written to a temp folder (``load_format="dummy"``, no tokenizer).
A kvpool node runs on 127.0.0.1.

1. **Parity**, in a process under the CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``): K/V
   written by vLLM's own ``reshape_and_cache_flash`` on a non-default stream into
   vLLM's per-layer views (``create_kv_cache_views``, every ``KVCacheLayout``), then
   kvpool's ``bhnc`` gather on another stream ordered by an event: the chunk equals the
   K/V written, and a scatter back gives the same bytes; no sanitizer report.
2. **Engines**, each backend x load mode in a process of its own, CUDA graphs on
   (vLLM's default cudagraph mode; ``layer`` makes vLLM fall back to piecewise),
   ``VLLM_GPU_SYNC_CHECK=warn``, chunks of one block (so kvpool and vLLM's own prefix
   cache hold the same prefix): a batch of 4 x 257- and 1 x 1000-token prompts is
   computed and saved; sent again, vLLM's own prefix cache serves it (the reference);
   then vLLM's prefix cache is emptied and the batch is sent a third time, loaded from
   kvpool. Passes when the loaded run's greedy tokens equal the reference's, every
   prompt's cached tokens come from the pool, no load failed, and no GPU-sync warning
   names kvpool.
3. **Extras** (``--extras``), the same flow in async mode: ``fp8`` (FLASH_ATTN with
   ``kv_cache_dtype="fp8"``: the connector moves the fp8 bytes) and ``block128``
   (FLASHINFER with ``--block-size 128``, which splits blocks into kernel blocks of 64
   on Hopper: the connector maps each block to its kernel blocks).

Prints a table, writes ``bench/results/gpu_accept.json``, exits 1 if a check failed
(2 without CUDA). ``--cpu`` runs the same flow on vLLM's CPU build (``CPU_ATTN``, no
CUDA graphs, no sanitizer): a check of this script, not of the GPU path.

**It has never run on a GPU**: no GPU has been lent to this project yet.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
#: a Llama small enough to start fast, with a head dim every GPU backend serves
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "kvpool_model_id": "kvpool-gpu-accept/tiny-llama-random",
}
PROMPTS = [257] * 4 + [1000]
SYNC_WARNING = "called a synchronizing CUDA operation"
#: where kvpool's GPU code lives (a sync warning naming a file there is kvpool's)
_GPU_SPEC = importlib.util.find_spec("kvpool.gpu")
KVPOOL_GPU_DIR = str(Path(_GPU_SPEC.origin or "").parent) if _GPU_SPEC else "kvpool/gpu"
MAX_TOKENS = 16


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(n)] for n in PROMPTS]


def parity(device: str) -> dict[str, Any]:
    """Step 1 (see the module doc), in this process."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout

    from kvpool.gpu.layout import KVLayout
    from kvpool.gpu.paged import gather, scatter

    layers, heads, head_dim, block, num_blocks = 3, 2, 64, 16, 12
    ids = torch.tensor([9, 2, 5], device=device)
    tokens = len(ids) * block
    slots = torch.cat([torch.arange(b * block, (b + 1) * block, device=device)
                       for b in ids.tolist()])
    out: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float16):
        spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_dim,
                                 dtype=dtype)
        for vllm_layout in KVCacheLayout:
            raw, caches = _views(spec, vllm_layout, layers, num_blocks, device)
            keys = torch.randn(layers, tokens, heads, head_dim, device=device).to(dtype)
            values = torch.randn(layers, tokens, heads, head_dim, device=device).to(dtype)
            engine = torch.cuda.Stream() if device == "cuda" else None  # type: ignore[no-untyped-call]
            if engine is not None:
                engine.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(engine):
                    _write(caches, keys, values, slots, head_dim)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(engine)
                torch.cuda.current_stream().wait_event(done)
            else:
                _write(caches, keys, values, slots, head_dim)
            layout = KVLayout(layers, heads, head_dim, dtype, block, kind="bhnc")
            layout.check(caches)
            chunk = torch.empty(layout.chunk_shape(tokens), dtype=dtype, device=device)
            gather(layout, caches, ids, chunk)
            back_raw, back = _views(spec, vllm_layout, layers, num_blocks, device)
            scatter(layout, back, ids, chunk)
            name = f"{vllm_layout.name}-{str(dtype).removeprefix('torch.')}"
            out[name] = bool(torch.equal(chunk, torch.stack([keys, values], dim=1))) and \
                bool(torch.equal(back_raw, raw))
    return out


def _views(spec: Any, vllm_layout: Any, layers: int, num_blocks: int, device: str
           ) -> tuple[Any, list[Any]]:
    """A zeroed backing buffer and the per-layer views vLLM's own code makes of it."""
    import torch
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    strides = compute_layout_strides(spec, num_blocks, layers, vllm_layout)
    size = spec.page_size_bytes * layers * num_blocks
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(layers)],
                           layer_stride=strides[0], block_stride=strides[1])
    return raw, create_kv_cache_views(raw, spec, num_blocks, vllm_layout, tensor)


def _write(caches: list[Any], keys: Any, values: Any, slots: Any, head_dim: int) -> None:
    """K/V into each layer's view the way vLLM's FlashAttention backend writes them."""
    import torch

    one = torch.ones((), dtype=torch.float32, device=keys.device)
    for layer, cache in enumerate(caches):
        k_cache, v_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
        if keys.device.type == "cuda":
            from vllm import _custom_ops as ops

            ops.reshape_and_cache_flash(keys[layer], values[layer], k_cache, v_cache, slots,
                                        "auto", one, one)
        else:  # --cpu: the same placement, by indexing
            block = k_cache.shape[1]
            for t, slot in enumerate(slots.tolist()):
                k_cache[slot // block, slot % block] = keys[layer, t]
                v_cache[slot // block, slot % block] = values[layer, t]


def engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Step 2 for one backend and mode (see the module doc), in this process."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    cpu = spec["cpu"]
    kwargs: dict[str, Any] = {}
    if not cpu:
        kwargs.update(attention_backend=spec["backend"], block_size=16,
                      compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
        kwargs.update(spec.get("engine_args") or {})
    block = 128 if cpu else int(kwargs["block_size"])
    transfer = KVTransferConfig(
        kv_connector="KvpoolConnector", kv_connector_module_path="kvpool.gpu.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kvpool_url": spec["url"], "load_mode": spec["mode"],
                                   "chunk_tokens": block})
    llm = LLM(model=spec["model"], load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=2048, seed=0, enforce_eager=cpu,
              enable_prefix_caching=True, gpu_memory_utilization=0.3 if not cpu else 0.2,
              kv_transfer_config=transfer, **kwargs)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]

    def run() -> tuple[list[list[int]], list[int], float]:
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        return ([list(o.outputs[0].token_ids) for o in outs],
                [int(o.num_cached_tokens or 0) for o in outs], time.perf_counter() - t0)

    computed = run()
    own = run()  # vLLM's own prefix cache
    time.sleep(1.0)  # (saves are off the step: they finish meanwhile or are waited for)
    llm.reset_prefix_cache()
    loaded = run()
    cudagraph = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    llm.llm_engine.engine_core.shutdown()
    return {"computed": computed, "own": own, "loaded": loaded, "cudagraph_mode": cudagraph,
            "block": block}


def _engine_process(spec: dict[str, Any], tmp: Path, timeout: float) -> dict[str, Any]:
    spec_file, out_file = tmp / f"spec-{time.monotonic_ns()}.json", tmp / "out.json"
    spec_file.write_text(json.dumps(spec))
    out_file.unlink(missing_ok=True)
    env = {**os.environ, "VLLM_GPU_SYNC_CHECK": "warn", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "bench.gpu_accept", "--engine",
                               str(spec_file), str(out_file)], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, env=env, check=False)
        log, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        log, rc = str(exc.stdout or "") + str(exc.stderr or ""), -1
    result: dict[str, Any] = json.loads(out_file.read_text()) if out_file.exists() else {}
    result.update(rc=rc, seconds=round(time.perf_counter() - t0, 1), log_tail=log[-4000:])
    # torch's "warn"-mode text, which VLLM_GPU_SYNC_CHECK turns on after warmup; the
    # warning names the file whose call synchronized
    syncs = [line for line in log.splitlines() if SYNC_WARNING in line]
    result["sync_warnings"] = len(syncs)
    result["sync_warnings_kvpool"] = sum(1 for line in syncs if KVPOOL_GPU_DIR in line)
    result["load_failures"] = log.count("Recovered from KV load failure")
    return result


def verdict(result: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    if result.get("rc") != 0 or "loaded" not in result:
        return {"ok": False, "why": f"engine exited {result.get('rc')}"}
    block = result["block"]
    want_cached = [(len(p) - 1) // block * block for p in prompts]
    checks = {
        "tokens_equal_own_prefix_cache": result["loaded"][0] == result["own"][0],
        "cached_from_pool": result["loaded"][1] == want_cached,
        "no_load_failure": result["load_failures"] == 0,
        "no_kvpool_sync_warning": result["sync_warnings_kvpool"] == 0,
    }
    return {"ok": all(checks.values()), **checks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="FLASH_ATTN,FLASHINFER,TRITON_ATTN")
    parser.add_argument("--modes", default="async,sync,layer")
    parser.add_argument("--extras", default="fp8,block128",
                        help="extra engine runs: fp8 (FLASH_ATTN, fp8 KV cache), block128 "
                             "(FLASHINFER, blocks of 128); empty for none")
    parser.add_argument("--cpu", action="store_true",
                        help="vLLM's CPU build: a check of this script, not of the GPU path")
    parser.add_argument("--engine-timeout", type=float, default=150.0)
    parser.add_argument("--node-python", default=sys.executable,
                        help="the interpreter that runs the kvpool node (kvpool[server] "
                             "installed; default: this one)")
    parser.add_argument("--out", default=str(RESULTS / "gpu_accept.json"))
    parser.add_argument("--engine", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--parity", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = sorted({n for n in args.extras.split(",") if n} - {"fp8", "block128"})
    if unknown:
        parser.error(f"--extras: unknown {unknown} (fp8, block128)")
    if args.engine:
        from bench._procs import engine_entry

        engine_entry(args.engine, engine)
    if args.parity:
        Path(args.parity[1]).write_text(json.dumps(parity(args.parity[0])))
        return 0

    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("bench.gpu_accept: no CUDA device here (--cpu checks the script on vLLM's "
              "CPU build)")
        return 2
    from bench._procs import start_node

    started = time.perf_counter()
    report: dict[str, Any] = {"device": "cpu" if args.cpu else torch.cuda.get_device_name(),
                              "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="kvpool-gpu-accept-") as tmp_name:
        tmp = Path(tmp_name)
        model = tmp / "tiny-llama"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY_LLAMA))
        # 1. parity, under the sanitizer on CUDA
        env = dict(os.environ)
        if not args.cpu:
            env["TORCH_CUDA_SANITIZER"] = "1"
        out = tmp / "parity.json"
        done = subprocess.run([sys.executable, "-m", "bench.gpu_accept", "--parity",
                               "cpu" if args.cpu else "cuda", str(out)], capture_output=True,
                              text=True, timeout=300, cwd=ROOT, env=env, check=False)
        cases = json.loads(out.read_text()) if out.exists() else {}
        report["parity"] = {"ok": done.returncode == 0 and bool(cases)
                            and all(cases.values())
                            and "CSAN" not in done.stderr, "cases": cases,
                            "sanitizer": not args.cpu, "log_tail": done.stderr[-2000:]}
        # 2. engines
        node = start_node("--dram-capacity", "2GiB", "--no-ssd", python=args.node_python)
        try:
            backends = ["CPU_ATTN"] if args.cpu else args.backends.split(",")
            runs: dict[str, Any] = {}
            for i, backend in enumerate(backends):
                for j, mode in enumerate(args.modes.split(",")):
                    prompts = _prompts(100 * i + j)  # new prefixes: a cold pool each time
                    result = _engine_process(
                        {"cpu": args.cpu, "backend": backend, "mode": mode, "url": node.url,
                         "model": str(model), "prompts": prompts}, tmp, args.engine_timeout)
                    result["verdict"] = verdict(result, prompts)
                    runs[f"{backend}/{mode}"] = result
                    print(f"{backend:12} {mode:6} {result['seconds']:6.1f} s  "
                          f"{result['verdict']}", flush=True)
            extras = {"fp8": ("FLASH_ATTN", {"kv_cache_dtype": "fp8"}),
                      "block128": ("FLASHINFER", {"block_size": 128})}
            for k, name in enumerate(n for n in args.extras.split(",") if n and not args.cpu):
                backend, engine_args = extras[name]
                prompts = _prompts(1000 + k)
                result = _engine_process(
                    {"cpu": False, "backend": backend, "mode": "async", "url": node.url,
                     "model": str(model), "prompts": prompts, "engine_args": engine_args},
                    tmp, args.engine_timeout)
                result["verdict"] = verdict(result, prompts)
                runs[f"{backend}/{name}"] = result
                print(f"{backend:12} {name:8} {result['seconds']:6.1f} s  "
                      f"{result['verdict']}", flush=True)
            report["engines"] = runs
        finally:
            node.stop()
    report["seconds"] = round(time.perf_counter() - started, 1)
    ok = report["parity"]["ok"] and all(r["verdict"]["ok"] for r in report["engines"].values())
    report["ok"] = ok
    print(f"\nkvpool GPU acceptance on {report['device']}: parity "
          f"{'ok' if report['parity']['ok'] else 'FAILED'}; engines "
          f"{sum(r['verdict']['ok'] for r in report['engines'].values())}/"
          f"{len(report['engines'])} ok; {report['seconds']} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
