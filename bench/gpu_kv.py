"""GPU-client benchmark (runs on CPU tensors here; the same code path as CUDA).

(a) TTFT cold vs warm with SmolLM2-135M (fp32) for 1k, 2k and 4k-token prompts:
    cold = full prefill; warm = load the cached prefix into paged blocks, rebuild
    the DynamicCache, prefill the remainder. Chunks of 256 and of 64 tokens.
(b) load into paged blocks (PagedKVConnector.load), direct (received straight into
    the blocks) and staged (through the staging ring and the copy thread, the CUDA
    path), vs plain get_many_into of the same chunks into preallocated buffers;
(c) store from paged blocks, direct and staged, vs plain put_many of the same bytes;
    all interleaved in the same run, and each run over TCP then through shared memory
    (the shm / TCP ratios pair the two paths' samples of a run).

    python -m bench.gpu_kv            # ~4 minutes; --quick for a smoke run

Prints a table and writes bench/results/gpu_kv.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from bench._procs import start_node
from bench._stats import summary
from kvpool.client import Client
from kvpool.gpu import KVLayout, PagedKVConnector

RESULTS = Path(__file__).resolve().parent / "results"


def bench_ttft(url: str, lengths: list[int], runs: int, chunk_sizes: list[int]
               ) -> list[dict[str, Any]]:
    from transformers import DynamicCache

    from kvpool.examples.models import SMOLLM2_ID, load_smollm2
    from kvpool.gpu.hf import HFCacheConnector, generate_greedy

    model, tokenizer = load_smollm2()
    text = " ".join(f"Section {i}. A shared KV cache keeps the attention keys and values of "
                    f"prompt prefixes so that engines need not recompute them." for i in range(800))
    all_ids: list[int] = tokenizer(text).input_ids
    rows = []
    with Client(url) as client:
        for n in lengths:
            ids = all_ids[:n]
            cold = []
            for _ in range(runs):
                cold.append(generate_greedy(model, ids, DynamicCache(config=model.config),
                                            1).ttft_s)
            for chunk in chunk_sizes:
                model_id = f"{SMOLLM2_ID}/bench-{uuid.uuid4().hex[:8]}"
                with HFCacheConnector(client, model.config, model_id=model_id,
                                      chunk_tokens=chunk, max_tokens=max(lengths)) as conn:
                    cache = DynamicCache(config=model.config)
                    reference = generate_greedy(model, ids, cache, 1)
                    conn.store(ids, cache)
                    warm, loaded, load_s = [], 0, []
                    for _ in range(runs):
                        t0 = time.perf_counter()
                        cache, loaded = conn.load(ids)
                        t1 = time.perf_counter()
                        gen = generate_greedy(model, ids, cache, 1, start=loaded)
                        warm.append(time.perf_counter() - t0)
                        load_s.append(t1 - t0)
                        assert gen.tokens == reference.tokens
                    rows.append({"tokens": n, "chunk_tokens": chunk, "loaded": loaded,
                                 "cold_s": summary(cold), "warm_s": summary(warm),
                                 "load_s": summary(load_s),
                                 "speedup": statistics.median(cold) / statistics.median(warm)})
                    print(f"  TTFT {n} tokens, chunks of {chunk}: done", flush=True)
    return rows


#: the transfer series, per path
TRANSFERS = ("load direct", "load staged", "get_many_into", "store direct", "store staged",
             "put_many")


def bench_transfer(url: str, chunks: int, runs: int) -> dict[str, Any]:
    """Load/store rates through both client paths, TCP and shared memory, a run of each
    in turn (so that the paired ``shm / TCP`` ratios of a run see the same machine)."""
    # SmolLM2's geometry: 30 layers, 3 KV heads, head dim 64, fp32, vLLM blocks of 16
    layout = KVLayout(30, 3, 64, torch.float32, 16)
    chunk_tokens = 256
    nbytes = layout.chunk_nbytes(chunk_tokens)
    per_chunk = chunk_tokens // layout.block_size
    num_blocks = chunks * per_chunk * 2
    caches = torch.randn((layout.num_layers, *layout.layer_shape(num_blocks)))
    tokens = list(range(chunks * chunk_tokens))
    src_blocks = list(range(0, chunks * per_chunk))
    dst_blocks = list(range(chunks * per_chunk, 2 * chunks * per_chunk))
    buffers = [bytearray(nbytes) for _ in range(chunks)]
    modes = {"direct": True, "staged": False}
    paths = ("tcp", "shm")
    out: dict[str, dict[str, list[float]]] = {p: {name: [] for name in TRANSFERS}
                                              for p in paths}
    total = chunks * nbytes
    with Client(url, shm=False) as tcp, Client(url, shm=True) as fast:
        for _ in range(runs):
            for path, client in zip(paths, (tcp, fast), strict=True):
                rates = out[path]
                for mode, direct in modes.items():
                    ns = layout.namespace(f"bench-{uuid.uuid4().hex[:8]}",
                                          chunk_tokens=chunk_tokens)
                    caches[:, :, dst_blocks] = 0
                    with PagedKVConnector(client, layout, caches, ns, direct=direct) as conn:
                        t0 = time.perf_counter()
                        assert conn.store(tokens, src_blocks) == len(tokens)
                        rates[f"store {mode}"].append(total / (time.perf_counter() - t0) / 1e9)
                        keys = conn._async.hasher.keys(tokens)
                        t0 = time.perf_counter()
                        assert conn.load(tokens, dst_blocks) == len(tokens)
                        rates[f"load {mode}"].append(total / (time.perf_counter() - t0) / 1e9)
                    assert torch.equal(caches[:, :, dst_blocks], caches[:, :, src_blocks])
                    if mode == "staged":
                        t0 = time.perf_counter()
                        got = client.get_many_into(keys, buffers)
                        rates["get_many_into"].append(total / (time.perf_counter() - t0) / 1e9)
                        assert all(g == nbytes for g in got)
                    client.delete_many(keys)
                plain = [os.urandom(16) for _ in range(chunks)]
                t0 = time.perf_counter()
                client.put_many(plain, buffers)
                rates["put_many"].append(total / (time.perf_counter() - t0) / 1e9)
                client.delete_many(plain)
    base = {"load": "get_many_into", "store": "put_many"}
    result: dict[str, Any] = {}
    for path in paths:
        medians = {k: statistics.median(v) for k, v in out[path].items()}
        result[path] = {"chunks": chunks, "chunk_bytes": nbytes,
                        "rates": {k: {**summary(v), "samples": v} for k, v in out[path].items()},
                        "ratios": {k: medians[k] / medians[base[k.split()[0]]]
                                   for k in out[path] if k.split()[0] in base}}
    # shm over TCP, paired run by run
    result["shm_over_tcp"] = {k: summary([a / b for a, b in zip(out["shm"][k], out["tcp"][k],
                                                                  strict=True)])
                              for k in TRANSFERS}
    return result


def report(results: dict[str, Any]) -> str:
    lines = ["| prompt tokens | chunk tokens | loaded | cold TTFT s median [min-max] | "
             "warm TTFT s median [min-max] | of which load s | cold / warm |",
             "|---|---|---|---|---|---|---|"]

    def fmt(s: dict[str, float], digits: int = 3) -> str:
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"

    for r in results["ttft"]:
        lines.append(f"| {r['tokens']} | {r['chunk_tokens']} | {r['loaded']} | "
                     f"{fmt(r['cold_s'])} | {fmt(r['warm_s'])} | "
                     f"{r['load_s']['median']:.3f} | {r['speedup']:.1f}x |")
    paths = results["transfer"]
    t = paths["tcp"]
    lines += ["", f"Transfer: {t['chunks']} chunks of {t['chunk_bytes'] / 2**20:.1f} MiB "
              "(SmolLM2 geometry, 256 tokens), GB/s median [min-max], over TCP and through "
              "shared memory (GETs, and put calls of 1 MiB and more), a run of each in turn; "
              "shm / TCP: the median [min-max] of the runs' paired ratios:", "",
              "| operation | TCP GB/s | ÷ plain client | shm GB/s | ÷ plain client | shm / TCP |",
              "|---|---|---|---|---|---|"]
    for name in t["rates"]:
        cells = []
        for path in ("tcp", "shm"):
            ratio = paths[path]["ratios"].get(name)
            cells += [fmt(paths[path]["rates"][name], 2), f"{ratio:.2f}x" if ratio else ""]
        paired = paths.get("shm_over_tcp", {}).get(name)
        if paired:  # the median [min-max] of the runs' paired ratios
            gain = (f"{paired['median']:.2f}x [{paired['min']:.2f}-{paired['max']:.2f}]")
        else:  # results from before the paths were paired: the ratio of the medians
            gain = f"{paths['shm']['rates'][name]['median'] / t['rates'][name]['median']:.2f}x"
        lines.append(f"| {name} | {' | '.join(cells)} | {gain} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="TTFT runs per setting (>= 3)")
    parser.add_argument("--transfer-runs", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=16, help="chunks per transfer run")
    parser.add_argument("--quick", action="store_true", help="1k tokens only, fewer runs")
    parser.add_argument("--transfer-only", action="store_true", help="skip the TTFT part")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_kv.json")
    args = parser.parse_args()
    lengths = [1024] if args.quick else [1024, 2048, 4096]
    runs = 1 if args.quick else args.runs
    node = start_node("--dram-capacity", "2GiB", "--no-ssd")
    try:
        transfer_runs = 2 if args.quick else args.transfer_runs
        transfer = bench_transfer(node.url, args.chunks, transfer_runs)
        print("  transfer: done", flush=True)
        ttft = [] if args.transfer_only else bench_ttft(node.url, lengths, runs, [256, 64])
    finally:
        node.stop()
    results = {"ttft": ttft, "transfer": transfer, "torch": torch.__version__,
               "cpus": os.cpu_count(), "python": platform.python_version(),
               "device": "cpu", "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(report(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
