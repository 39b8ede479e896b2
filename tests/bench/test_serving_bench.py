"""bench/serving.py's parts that decide what is measured: the seeded workloads, the cap on
vLLM's KV space, the measures and vLLM's metrics as read. (The engines run in
``python -m bench.serving``, not here.)"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from bench.serving import (
    Record,
    Workload,
    _one,
    engine_steps,
    multi_round_qa,
    rate_table,
    ratios,
    render,
    scrape,
    shared_prefixes,
    step_table,
    summarize,
)


def test_multi_round_qa_is_seeded_and_each_round_extends_the_last() -> None:
    work = multi_round_qa(7, users=5, rounds=3, system=64, context=(100, 200), question=8,
                          answer=16)
    assert work == multi_round_qa(7, users=5, rounds=3, system=64, context=(100, 200),
                                  question=8, answer=16)
    assert work.sessions != multi_round_qa(8, users=5, rounds=3, system=64,
                                           context=(100, 200), question=8,
                                           answer=16).sessions
    assert work.requests == 15
    heads = {tuple(s[0][:64]) for s in work.sessions}
    assert len(heads) == 1  # one system prompt for every user
    for session in work.sessions:
        for before, after in itertools.pairwise(session):
            assert after[:len(before)] == before  # the last prompt, its answer, a question
            assert len(after) == len(before) + 16 + 8
        assert 64 + 100 + 8 <= len(session[0]) <= 64 + 200 + 8
    contexts = {tuple(s[0][64:164]) for s in work.sessions}
    assert len(contexts) == 5  # a context of each user's own


def test_shared_prefixes_mixes_documents_and_one_off_prompts() -> None:
    work = shared_prefixes(3, 200, documents=3, document=300, question=10, one_off=0.25,
                           one_off_tokens=(50, 60))
    assert work.requests == 200 and all(len(s) == 1 for s in work.sessions)
    prompts = [s[0] for s in work.sessions]
    docs = [p for p in prompts if len(p) == 310]
    one_off = [p for p in prompts if 50 <= len(p) <= 60]
    assert len(docs) + len(one_off) == 200 and 30 <= len(one_off) <= 70
    by_doc: dict[tuple[int, ...], int] = {}
    for p in docs:
        by_doc[tuple(p[:300])] = by_doc.get(tuple(p[:300]), 0) + 1
    counts = sorted(by_doc.values(), reverse=True)
    assert len(counts) == 3 and counts[0] > counts[-1]  # the first document asked most


def test_distinct_blocks_counts_each_prefix_block_once() -> None:
    a, b = list(range(300)), list(range(256)) + [7] * 44
    work = Workload("t", [[a], [b], [a[:128]]])
    # a: blocks 0, 1 (2 full of 128); b shares both (its tail is partial); a[:128]: block 0
    assert work.distinct_blocks(128) == 2
    c = [5, *list(range(1, 300))]
    assert Workload("t", [[a], [c]]).distinct_blocks(128) == 4  # no shared prefix


def test_summary_percentiles_failures_and_cache_share() -> None:
    records = [Record(i, 0, 1000, ttft=t, itls=[0.01 * (i + 1)] * 4, output_tokens=5,
                      cached_tokens=c) for i, (t, c) in enumerate(
                          [(1.0, 0), (2.0, 500), (3.0, 1000), (4.0, 1000)])]
    records.append(Record(9, 0, 1000, error="HTTP 500: boom"))
    s = summarize(records, wall=10.0)
    assert s["requests"] == 5 and s["failed"] == 1 and s["errors"] == ["HTTP 500: boom"]
    assert s["ttft_mean_s"] == 2.5 and s["ttft_p50_s"] == 3.0 and s["ttft_p99_s"] == 4.0
    assert s["itl_p50_s"] == pytest.approx(0.03) and s["itl_p99_s"] == pytest.approx(0.04)
    assert s["requests_per_s"] == 0.4 and s["output_tokens_per_s"] == 2.0
    assert s["cached_share"] == 2500 / 4000


def test_ratios_are_the_issues_targets() -> None:
    a = {"ttft_mean_s": 2.0, "ttft_p99_s": 4.0, "requests_per_s": 1.0, "itl_p99_s": 0.1,
         "cached_share": 0.2}
    c = {"ttft_mean_s": 0.5, "ttft_p99_s": 2.0, "requests_per_s": 1.5, "itl_p99_s": 0.105,
         "cached_share": 0.6}
    out = ratios({"qa/a": a, "qa/c": c, "qa/d-shared": {"cached_share": 0.5},
                  "qa/d-alone": {"cached_share": 0.25},
                  "qa/e": {"failed": 0, "after_restart": {"requests": 3,
                                                          "cached_share": 0.9}}})
    assert out["qa"] == pytest.approx({"c/a ttft mean": 0.25, "c/a ttft p99": 0.5,
                                       "c/a req/s": 1.5, "c/a itl p99": 1.05,
                                       "d shared/alone cached": 2.0, "e failed": 0,
                                       "e requests after the restart": 3,
                                       "e cached share after the restart": 0.9})


def test_a_rate_sweep_has_a_row_a_configuration_and_rate() -> None:
    served = {"label": "vLLM alone", "offered_per_s": 0.2, "requests_per_s": 0.19,
              "output_tokens_per_s": 6.1, "ttft_mean_s": 1.5, "ttft_p99_s": 3.25,
              "itl_p50_s": 0.1, "itl_p99_s": 0.3, "cached_share": 0.4, "failed": 1}
    rows = rate_table({"shared/a@0.2": served,
                       "shared/c@0.4": {"label": "vLLM + kvpool", "error": "no start"}})
    assert rows[2] == ("| shared | a vLLM alone | 0.20 | 0.19 | 6 | 1.50 / 3.25 | 100 / 300 "
                       "| 0.40 | 1 |")
    assert rows[3].startswith("| shared | c vLLM + kvpool | 0.4 | did not run: no start")
    assert len(rows) == 4


def test_a_saved_report_is_rendered_with_measures_added_since_from_its_samples(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run = {"label": "vLLM alone", "ttft_mean_s": 1.0, "ttft_p50_s": 1.0, "ttft_p90_s": 2.0,
           "ttft_p99_s": 3.0, "itl_p50_s": 0.05, "itl_p99_s": 0.5, "requests_per_s": 0.5,
           "output_tokens_per_s": 16.0, "cached_share": 0.25, "failed": 0,
           "kvpool": {"hits": 7, "misses": 1},
           "samples": {"ttft_s": [1.0], "itl_s": [0.01 * i for i in range(1, 101)]}}
    path = tmp_path / "serving.json"
    path.write_text(json.dumps({"results": {"qa/a": run}, "ratios": {}}))
    assert render(path, docs=False) == 0
    # p90 of 0.01..1.00 s: the 91st value; the node's chunk hits / misses
    assert ("| qa | a vLLM alone | 1.00 / 1.00 / 2.00 / 3.00 | 50 / 910 / 500 | 0.50 | 16 | "
            "0.25 | - | 7 / 1 | 0 |") in capsys.readouterr().out


def _iteration(i: int, ctx: int, ctx_tokens: int, gen: int, ms: float) -> str:
    # vLLM 0.32's line (v1/metrics/loggers.py, --enable-logging-iteration-details)
    return (f"(APIServer pid=1) INFO 12-07 13:00:00 [loggers.py:199] Iteration({i}): {ctx} "
            f"context requests, {ctx_tokens} context tokens, {gen} generation requests, "
            f"{gen} generation tokens, iteration elapsed time: {ms:.2f} ms, CPU KV cache "
            f"usage: 50.0%")


def test_engine_steps_split_decode_only_steps_by_batch_from_prefills(tmp_path: Any) -> None:
    one, two = tmp_path / "vllm0.log", tmp_path / "vllm1.log"
    one.write_text("\n".join([
        "(APIServer pid=1) INFO some other line",
        _iteration(0, 1, 2000, 0, 5000.0), _iteration(1, 0, 0, 1, 90.0),
        _iteration(2, 0, 0, 1, 110.0), _iteration(3, 0, 0, 2, 120.0),
        _iteration(4, 1, 64, 2, 300.0)]))
    two.write_text(_iteration(0, 0, 0, 1, 100.0))
    steps = engine_steps([one, two])
    assert steps["decode"] == {"1": {"count": 3, "median_ms": 100.0, "p90_ms": 110.0},
                               "2": {"count": 1, "median_ms": 120.0, "p90_ms": 120.0}}
    assert steps["with_prompt"] == {"count": 2, "median_ms": 2650.0, "p90_ms": 5000.0}
    assert steps["busy_s"] == pytest.approx(5.72) and steps["engines"] == 2
    rows = step_table({"qa/a": {"label": "vLLM alone", "steps": steps, "wall_s": 5.72},
                       "qa/c": {"label": "vLLM + kvpool", "error": "no start"}})
    assert rows[0] == ("| workload | config | 1 decoding | 2 decoding | steps with prompt "
                       "tokens | engine busy |")
    assert rows[2] == "| qa | a vLLM alone | 100.0 (3) | 120.0 (1) | 2650 (2) | 0.50 |"
    assert len(rows) == 3


@contextlib.asynccontextmanager
async def _http(app: web.Application) -> AsyncIterator[str]:
    """``app`` served on 127.0.0.1: its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def test_a_streamed_completion_is_timed_token_by_token() -> None:
    """Against a stand-in of vLLM's streaming endpoint on 127.0.0.1 (the SSE shape vLLM
    sends: a text delta a token, then usage with cached_tokens): TTFT, one ITL a later
    token, the cached tokens; an HTTP error is a failed request, not an exception."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["prompt"] == [0]:
            return web.Response(status=500, text="engine dead")
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        await asyncio.sleep(0.05)
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": f"t{i}"}]}
            await reply.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.02)
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                          "completion_tokens": body["max_tokens"],
                                          "prompt_tokens_details": {"cached_tokens": 256}}}
        await reply.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return reply

    async def run() -> tuple[Record, Record]:
        import aiohttp

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        async with _http(app) as url, aiohttp.ClientSession() as http:
            good, bad = Record(0, 0, 300), Record(1, 0, 1)
            await _one(http, url, list(range(300)), good, model="m", max_tokens=5,
                       limit_s=10)
            await _one(http, url, [0], bad, model="m", max_tokens=5, limit_s=10)
            return good, bad

    good, bad = asyncio.run(run())
    # (lower bounds only: the stand-in sleeps 50 ms before the first token and 20 ms
    # between tokens, so a measure from the wrong moment falls below them)
    assert good.error == "" and good.ttft is not None and good.ttft >= 0.04
    assert len(good.itls) == 4 and all(x >= 0.01 for x in good.itls)
    assert good.output_tokens == 5 and good.cached_tokens == 256
    assert bad.error.startswith("HTTP 500: engine dead") and bad.ttft is None


def test_vllms_prefix_cache_counters_are_read_from_its_metrics() -> None:
    text = "\n".join([
        "# HELP vllm:prefix_cache_queries_total x",
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0',
        'vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 900.0',
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 640.0',
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9'])

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text)

    async def run() -> dict[str, Any]:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        async with _http(app) as url:
            return await asyncio.to_thread(scrape, url)

    assert asyncio.run(run()) == {"prefix_cache_queries": 1200.0, "prefix_cache_hits": 300.0,
                                  "external_prefix_cache_queries": 900.0,
                                  "external_prefix_cache_hits": 640.0}
