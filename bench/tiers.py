"""Storage-tier benchmark: codecs on real KV tensors, the RocksDB tier, a node with DRAM over SSD.

    python -m bench.tiers            # ~2-3 minutes on 2 cores
    python -m bench.tiers --quick    # smoke run

Prints tables and writes JSON (``bench/results/tiers.json``):

1. codecs: compression ratio and encode/decode MB/s of none, lz4 and shuffle+lz4 on
   K/V tensors from a small Llama-shaped model (transformers, built from a config,
   seeded, 384-token prefill) in fp16, bf16 and fp32, and on random bytes. Needs
   ``pip install torch==2.13.0 transformers`` (the ``models`` extra); without them
   only random bytes are measured, and the table says so.
2. SSD tier (RocksDbTier in this process): write and read MB/s per value size and codec;
   S3 tier (S3Tier) PUT and GET MB/s against SeaweedFS on 127.0.0.1 (moto's server if
   SeaweedFS is not installed).
3. A node with DRAM over SSD: DRAM-hit GET p50/p99 while another client writes new
   chunks (their write-behind goes to the SSD worker) against the same node with no
   writer, and against a DRAM-only node; then GET throughput for a working set 4x
   larger than DRAM, with the share of GETs served by promotion from SSD.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._procs import start_node, start_seaweedfs
from kvpool.client import Client
from kvpool.protocol.envelope import Codec, seal
from kvpool.tiers.codec import decode, encode
from kvpool.tiers.rocksdb import RocksDbTier
from kvpool.tiers.s3 import S3Tier

MiB = 1 << 20
CODECS = {"none": Codec.RAW, "lz4": Codec.LZ4, "shuffle-lz4": Codec.SHUFFLE_LZ4}


def kv_payloads(num_tokens: int) -> tuple[dict[str, bytes], str]:
    """One chunk's K/V bytes per dtype, from a real (randomly initialised) Llama forward pass."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return {}, "torch/transformers not installed: real KV tensors skipped"
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                         max_position_embeddings=2048)
    model = LlamaForCausalLM(config)  # dropout is 0 in this config: no .eval() needed
    ids = torch.randint(0, config.vocab_size, (1, num_tokens))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    # [layers, 2, tokens, kv_heads, head_dim], the chunk payload layout of the GPU client
    kv = torch.stack([torch.stack([layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)])
                      for layer in cache.layers])
    out = {name: kv.to(dtype).contiguous().view(torch.uint8).numpy().tobytes()
           for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16),
                               ("fp32", torch.float32))}
    return out, (f"Llama-shaped model, 4 layers, 2 KV heads x 64, {num_tokens}-token prefill, "
                 f"seed 0 (transformers {__import__('transformers').__version__})")


def bench_codecs(runs: int, num_tokens: int) -> dict[str, Any]:
    payloads, source = kv_payloads(num_tokens)
    size = len(next(iter(payloads.values()))) if payloads else 4 * MiB
    payloads["random"] = os.urandom(size)
    rows = []
    for data_name, payload in payloads.items():
        elem = 4 if data_name == "fp32" else 2
        value = seal(payload) + payload
        for codec_name, codec in CODECS.items():
            enc, dec = [], []
            stored = b""
            for _ in range(runs):
                t = time.perf_counter()
                stored = encode(value, codec, elem_size=elem)
                enc.append(len(payload) / (time.perf_counter() - t) / 1e6)
                t = time.perf_counter()
                assert decode(stored) == value
                dec.append(len(payload) / (time.perf_counter() - t) / 1e6)
            rows.append({"data": data_name, "codec": codec_name, "bytes": len(payload),
                         "ratio": len(value) / len(stored),
                         "encode_mb_s": statistics.median(enc),
                         "decode_mb_s": statistics.median(dec)})
    return {"source": source, "rows": rows}


def bench_ssd(total_mib: int, runs: int) -> list[dict[str, Any]]:
    payloads, _ = kv_payloads(256)
    kv = payloads.get("bf16")
    rows = []
    for size in (1 * MiB, 4 * MiB):
        for codec_name in ("none", "lz4"):
            writes, reads = [], []
            for run in range(runs):
                with tempfile.TemporaryDirectory(prefix="kvpool-bench-ssd-") as path:
                    tier = RocksDbTier(path, 4 * total_mib * MiB, codec=CODECS[codec_name])
                    count = max(4, total_mib * MiB // size)
                    base = (kv * (size // len(kv) + 1))[:size] if kv else os.urandom(size)
                    values = [seal(base) + base for _ in range(2)]
                    keys = [os.urandom(16) for _ in range(count)]
                    t = time.perf_counter()
                    for i, k in enumerate(keys):
                        tier.put(k, values[i % 2])
                    writes.append(count * size / (time.perf_counter() - t) / 1e6)
                    t = time.perf_counter()
                    for k in keys:
                        assert tier.get(k) is not None
                    reads.append(count * size / (time.perf_counter() - t) / 1e6)
                    tier.close()
                    del run
            rows.append({"value": f"{size >> 20} MiB", "codec": codec_name,
                         "data": "bf16 KV" if kv else "random",
                         "write_mb_s": statistics.median(writes),
                         "read_mb_s": statistics.median(reads)})
    return rows


SSD_VARIANTS: dict[str, dict[str, Any]] = {
    "default (64 MiB write buffers)": {"write_buffer_bytes": 64 * MiB},
    "256 MiB write buffers": {"write_buffer_bytes": 256 * MiB},
    "blob files": {"blob_files": True},
}


def bench_ssd_options(total_mib: int, runs: int) -> list[dict[str, Any]]:
    """RocksDB options across value sizes: the numbers behind the tier's defaults."""
    rows = []
    for size in (256 << 10, 4 * MiB, 32 * MiB):
        payload = os.urandom(size)
        value = seal(payload) + payload
        for variant, options in SSD_VARIANTS.items():
            writes, reads = [], []
            for _ in range(runs):
                with tempfile.TemporaryDirectory(prefix="kvpool-bench-ssdopt-") as path:
                    tier = RocksDbTier(path, 8 * total_mib * MiB, codec=Codec.RAW, **options)
                    keys = [os.urandom(16) for _ in range(max(4, total_mib * MiB // size))]
                    t = time.perf_counter()
                    for k in keys:
                        tier.put(k, value)
                    writes.append(len(keys) * size / (time.perf_counter() - t) / 1e6)
                    t = time.perf_counter()
                    for k in keys:
                        assert tier.get(k) is not None
                    reads.append(len(keys) * size / (time.perf_counter() - t) / 1e6)
                    tier.close()
            rows.append({"value": f"{size >> 10} KiB" if size < MiB else f"{size >> 20} MiB",
                         "options": variant, "write_mb_s": statistics.median(writes),
                         "read_mb_s": statistics.median(reads)})
    return rows


def bench_s3(total_mib: int, runs: int) -> dict[str, Any]:
    """S3Tier PUT/GET MB/s against a local S3 server: SeaweedFS if installed, else moto's."""
    import boto3

    payloads, _ = kv_payloads(256)
    kv = payloads.get("bf16")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-s3-") as root:
        access, secret, bucket = "kvpool-bench", "kvpool-bench-secret", "kvpool-bench"
        server = start_seaweedfs(Path(root), access, secret, bucket)
        moto = None
        if server is not None:
            endpoint, label = server.url, "SeaweedFS (weed mini) on 127.0.0.1"
        else:
            from moto.server import ThreadedMotoServer

            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            moto.start()
            host, port = moto.get_host_and_port()
            endpoint, label = f"http://{host}:{port}", "moto server (in this process)"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id=access, aws_secret_access_key=secret)
        if moto is not None:
            client.create_bucket(Bucket=bucket)
        try:
            for size in (1 * MiB, 4 * MiB):
                base = (kv * (size // len(kv) + 1))[:size] if kv else os.urandom(size)
                value = seal(base) + base
                for codec_name in ("none", "shuffle-lz4"):
                    puts, gets = [], []
                    for run in range(runs):
                        tier = S3Tier(bucket, prefix=f"b{size}-{codec_name}-{run}",
                                      client=client, codec=CODECS[codec_name])
                        keys = [os.urandom(16) for _ in range(max(4, total_mib * MiB // size))]
                        t = time.perf_counter()
                        for k in keys:
                            assert tier.put(k, value)
                        puts.append(len(keys) * size / (time.perf_counter() - t) / 1e6)
                        t = time.perf_counter()
                        for k in keys:
                            assert tier.get(k) == value
                        gets.append(len(keys) * size / (time.perf_counter() - t) / 1e6)
                    rows.append({"value": f"{size >> 20} MiB", "codec": codec_name,
                                 "data": "bf16 KV" if kv else "random",
                                 "put_mb_s": statistics.median(puts),
                                 "get_mb_s": statistics.median(gets)})
        finally:
            if server is not None:
                server.stop()
            if moto is not None:
                moto.stop()
    return {"server": label, "rows": rows}


def _latency(client: Client, key: bytes, buf: bytearray, samples: int) -> dict[str, float]:
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        client.get_into(key, buf)
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return {"p50_ms": times[len(times) // 2], "p99_ms": times[int(len(times) * 0.99)]}


def _writer(url: str, stop: Any, written: Any) -> None:
    with Client(url, pool_size=1) as w:
        payload = os.urandom(4 * MiB)
        while not stop.is_set():
            w.put(os.urandom(16), payload)
            with written.get_lock():
                written.value += 1


def bench_dram_hit_under_demotion(samples: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, flags in (("DRAM only (--no-ssd)", ("--no-ssd",)), ("DRAM + SSD", ())):
        node = start_node("--dram-capacity", "256MiB", "--ssd-capacity", "2GiB", *flags)
        try:
            reader = Client(node.url, pool_size=1)
            key, value = os.urandom(16), os.urandom(MiB)
            reader.put(key, value)
            buf = bytearray(MiB)
            out[f"{label}, idle"] = _latency(reader, key, buf, samples)
            # the writer is another process: a thread would share the reader's GIL
            ctx = mp.get_context("spawn")
            stop = ctx.Event()
            written = ctx.Value("i", 0)
            writer = ctx.Process(target=_writer, args=(node.url, stop, written))
            writer.start()
            time.sleep(1.0)
            out[f"{label}, 4 MiB writer"] = _latency(reader, key, buf, samples)
            stop.set()
            writer.join(60)
            out[f"{label}, 4 MiB writer"]["chunks_written"] = written.value
            if written.value == 0:
                raise RuntimeError("the writer process wrote nothing: the comparison is void")
            tiers = reader.stats()["tiers"]
            if "ssd" in tiers:
                out[f"{label}, 4 MiB writer"]["ssd_writes"] = tiers["ssd"]["writes"]
                out[f"{label}, 4 MiB writer"]["ssd_shed"] = tiers["ssd"]["shed"]
            reader.close()
        finally:
            node.stop()
    return out


def bench_working_set(dram_mib: int, factor: int) -> dict[str, Any]:
    node = start_node("--dram-capacity", f"{dram_mib}MiB", "--ssd-capacity", "4GiB")
    try:
        with Client(node.url, pool_size=1) as c:
            size = MiB
            count = dram_mib * factor
            keys = [os.urandom(16) for _ in range(count)]
            payload = os.urandom(size)
            deadline = time.monotonic() + 300
            for i, k in enumerate(keys):
                c.put(k, payload)
                while (c.stats()["tiers"]["ssd"]["writes"] < i + 1
                       and time.monotonic() < deadline):
                    time.sleep(0.002)  # paced, so the working set really reaches the SSD
            before = c.stats()["promotions"]
            order = list(keys)
            import random

            random.Random(0).shuffle(order)
            buf = bytearray(size)
            t = time.perf_counter()
            hits = sum(c.get_into(k, buf) is not None for k in order)
            elapsed = time.perf_counter() - t
            promoted = c.stats()["promotions"] - before
        return {"dram_mib": dram_mib, "working_set_mib": count, "gets": count, "hits": hits,
                "gb_s": count * size / elapsed / 1e9, "served_from_ssd": promoted / count}
    finally:
        node.stop()


def report(results: dict[str, Any]) -> str:
    lines = [f"Codecs ({results['codecs']['source']}):", "",
             "| data | codec | ratio | encode MB/s | decode MB/s |", "|---|---|---|---|---|"]
    for r in results["codecs"]["rows"]:
        lines.append(f"| {r['data']} | {r['codec']} | {r['ratio']:.2f} | "
                     f"{r['encode_mb_s']:.0f} | {r['decode_mb_s']:.0f} |")
    lines += ["", "SSD tier (RocksDbTier, one process):", "",
              "| value | codec | data | write MB/s | read MB/s |", "|---|---|---|---|---|"]
    for r in results["ssd"]:
        lines.append(f"| {r['value']} | {r['codec']} | {r['data']} | {r['write_mb_s']:.0f} | "
                     f"{r['read_mb_s']:.0f} |")
    lines += ["", "RocksDB options (random bytes, codec none):", "",
              "| value | options | write MB/s | read MB/s |", "|---|---|---|---|"]
    for r in results["ssd_options"]:
        lines.append(f"| {r['value']} | {r['options']} | {r['write_mb_s']:.0f} | "
                     f"{r['read_mb_s']:.0f} |")
    lines += ["", f"S3 tier (S3Tier, one thread, against {results['s3']['server']}):", "",
              "| value | codec | data | PUT MB/s | GET MB/s |", "|---|---|---|---|---|"]
    for r in results["s3"]["rows"]:
        lines.append(f"| {r['value']} | {r['codec']} | {r['data']} | {r['put_mb_s']:.0f} | "
                     f"{r['get_mb_s']:.0f} |")
    lines += ["", "DRAM-hit GET of 1 MiB while another client writes 4 MiB chunks:", "",
              "| node, load | p50 ms | p99 ms | chunks written | SSD writes | shed |",
              "|---|---|---|---|---|---|"]
    for name, r in results["dram_hit"].items():
        lines.append(f"| {name} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
                     f"{r.get('chunks_written', '')} | {r.get('ssd_writes', '')} | "
                     f"{r.get('ssd_shed', '')} |")
    w = results["working_set"]
    lines += ["", f"Working set {w['working_set_mib']} MiB over a {w['dram_mib']} MiB DRAM tier "
              f"(1 MiB GETs, random order): {w['gb_s']:.2f} GB/s, {w['hits']}/{w['gets']} hits, "
              f"{w['served_from_ssd']:.0%} promoted from SSD."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/tiers.json"))
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    results = {
        "codecs": bench_codecs(runs, 256),
        "ssd": bench_ssd(32 if args.quick else 256, 1 if args.quick else 3),
        "ssd_options": bench_ssd_options(32 if args.quick else 128, 1 if args.quick else 3),
        "s3": bench_s3(16 if args.quick else 64, 1 if args.quick else 3),
        "dram_hit": bench_dram_hit_under_demotion(100 if args.quick else 1000),
        "working_set": bench_working_set(16 if args.quick else 64, 4),
        "machine": {"cpus": os.cpu_count(), "when": time.strftime("%F %T")},
    }
    print(report(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
