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
    multi_round_qa,
    ratios,
    scrape,
    shared_prefixes,
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
                  "qa/d-alone": {"cached_share": 0.25}})
    assert out["qa"] == pytest.approx({"c/a ttft mean": 0.25, "c/a ttft p99": 0.5,
                                       "c/a req/s": 1.5, "c/a itl p99": 1.05,
                                       "d shared/alone cached": 2.0})


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
