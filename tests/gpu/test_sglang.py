"""SGLang's HiCache (PyPI's sglang 0.5.23) keeping its L3 pages in kvpool, through real nodes.

SGLang lives in the engines' environment (``$VLLM_CPU_PYTHON``, made by ``.ci/run``),
driven by ``tests/sglang_driver.py`` (see its doc for what of SGLang runs there); the
nodes and the checks run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.cli.local_cluster import LocalCluster
from kvpool.client import Client
from kvpool.protocol.frames import Op
from tests.client.test_hostile_nodes import HalfLies, claims_1000, one_more_item, only
from tests.conftest import ROOT, NodeProcess, put_corrupt, start_node
from tests.hostile_node import LyingNode, hello_with

PYTHON = os.environ.get("VLLM_CPU_PYTHON", "")
if not PYTHON or not Path(PYTHON).exists():
    if os.environ.get("CI"):
        pytest.fail("CI must set VLLM_CPU_PYTHON (.ci/run makes the engines' environment)",
                    pytrace=False)
    pytest.skip("set VLLM_CPU_PYTHON to a python with sglang==0.5.23 and kvpool "
                "(see .ci/run)", allow_module_level=True)

KEYS = [f"page-{i:02d}-of-a-prefix" for i in range(8)]  # SGLang chains the prefix itself


pytestmark = pytest.mark.slow  # SGLang's storage layer in the engines' environment


def driver(tmp: Path, steps: list[dict[str, Any]], timeout: float = 180) -> dict[str, Any]:
    spec, out = tmp / f"spec-{time.monotonic_ns()}.json", tmp / f"out-{time.monotonic_ns()}.json"
    spec.write_text(json.dumps({"steps": steps}))
    done = subprocess.run([PYTHON, "-m", "tests.sglang_driver", str(spec), str(out)],
                          capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT)
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = done.stderr
    return result


def results(run: dict[str, Any]) -> list[Any]:
    return [step["result"] for step in run["steps"]]


@pytest.fixture
def pool() -> Iterator[NodeProcess]:
    node = start_node("--dram-capacity", "256MiB", "--no-ssd")
    yield node
    node.stop()


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_pages_stored_by_one_sglang_load_into_another(pool: NodeProcess, tmp_path: Path,
                                                      layout: str) -> None:
    """Backend A stores 6 pages from its host pool; backend B (another process, another
    pool) finds the leading 6, loads them zero-copy into other pages of its pool, bit for
    bit; the copying interface reads the same bytes as SGLang's flat data pages."""
    pool_args = {"layout": layout, "page_size": 16, "pages": 8}
    store = driver(tmp_path, [
        {"do": "backend", "name": "a", "pool": "a", "url": pool.url, **pool_args},
        {"do": "fill", "pool": "a", "seed": 1},
        {"do": "exists", "name": "a", "keys": KEYS[:6]},
        {"do": "set", "name": "a", "keys": KEYS[:6], "pages": [0, 1, 2, 3, 4, 5]},
        {"do": "set", "name": "a", "keys": KEYS[:6], "pages": [0, 1, 2, 3, 4, 5]},
    ])
    made, _, before, first, again = results(store)
    assert made["made"], made
    assert made["kv_format"] == f"sglang-{layout}-pp0of1"
    assert before == 0 and first == [True] * 6 and again == [True] * 6
    assert store["counters"]["a"]["pages_stored"] == 6
    assert store["counters"]["a"]["pages_skipped"] == 6  # the second set sent nothing

    load = driver(tmp_path, [
        {"do": "backend", "name": "b", "pool": "b", "url": pool.url, **pool_args},
        {"do": "exists", "name": "b", "keys": KEYS},
        {"do": "get", "name": "b", "keys": KEYS[:6], "pages": [7, 6, 5, 4, 3, 2]},
        {"do": "get", "name": "b", "keys": KEYS[5:8], "pages": [0, 1, 2]},
        {"do": "backend", "name": "a", "pool": "a", "url": pool.url, **pool_args},
        {"do": "fill", "pool": "a", "seed": 1},  # A's pool again, to compare with
        {"do": "get_flat", "name": "b", "keys": KEYS[:2], "pages": [7, 6]},
    ])
    _, found, got, partial, _, _, flat = results(load)
    assert found == 6  # the leading pages the pool holds, in one round trip
    assert got == [True] * 6
    assert partial == [True, False, False]  # pages never stored are misses
    assert flat == [True, True]
    counters = load["counters"]["b"]
    assert counters["pages_loaded"] >= 7 and counters["errors"] == 0


def test_the_one_key_calls(pool: NodeProcess, tmp_path: Path) -> None:
    run = driver(tmp_path, [
        {"do": "backend", "name": "a", "pool": "a", "url": pool.url, "layout": "page_first",
         "page_size": 16, "pages": 8},
        {"do": "fill", "pool": "a", "seed": 4},
        {"do": "single", "name": "a", "key": "one-page", "page": 3},
    ])
    assert results(run)[2] == {"set": True, "exists": True, "missing": False,
                               "get_equal": True}


def test_loaded_pages_are_bit_exact(pool: NodeProcess, tmp_path: Path) -> None:
    """The bytes that arrive are the bytes that left: pool B's pages equal pool A's."""
    args = {"layout": "page_first", "page_size": 16, "pages": 8}
    run = driver(tmp_path, [
        {"do": "backend", "name": "a", "pool": "a", "url": pool.url, **args},
        {"do": "fill", "pool": "a", "seed": 7},
        {"do": "set", "name": "a", "keys": KEYS[:4], "pages": [0, 1, 2, 3]},
        {"do": "backend", "name": "b", "pool": "b", "url": pool.url, **args},
        {"do": "get", "name": "b", "keys": KEYS[:4], "pages": [0, 1, 2, 3]},
        {"do": "same", "a": "a", "b": "b", "pages": [0, 1, 2, 3, 4]},
    ])
    *_, got, same = results(run)
    assert got == [True] * 4
    assert same == [True, True, True, True, False]  # page 4 was never loaded into B


def test_a_corrupt_page_is_a_miss_and_the_others_load(pool: NodeProcess,
                                                      tmp_path: Path) -> None:
    args = {"layout": "page_first", "page_size": 16, "pages": 8}
    store = driver(tmp_path, [
        {"do": "backend", "name": "a", "pool": "a", "url": pool.url, **args},
        {"do": "fill", "pool": "a", "seed": 3},
        {"do": "set", "name": "a", "keys": KEYS[:4], "pages": [0, 1, 2, 3]},
    ])
    assert results(store)[2] == [True] * 4
    key = bytes.fromhex(_key_hex(tmp_path, pool, KEYS[2]))
    with Client(pool.url, shm=False) as c:
        original = bytes(c.get(key) or b"")
    assert original
    put_corrupt(pool, key, original, flip=100)
    load = driver(tmp_path, [
        {"do": "backend", "name": "b", "pool": "b", "url": pool.url, **args},
        {"do": "get", "name": "b", "keys": KEYS[:4], "pages": [0, 1, 2, 3]},
    ])
    assert results(load)[1] == [True, True, False, True]
    assert load["counters"]["b"]["errors"] == 0  # a bad page is a miss, not a pool failure


def _key_hex(tmp: Path, pool: NodeProcess, page_key: str) -> str:
    """The kvpool key the backend gives ``page_key`` (computed where SGLang is)."""
    code = ("import sys; from tests.sglang_driver import host_pool, make_backend; "
            "b = make_backend(sys.argv[1], host_pool('page_first', 16, 8), {}); "
            "print(b.key(sys.argv[2]).hex()); b.close()")
    done = subprocess.run([PYTHON, "-c", code, pool.url, page_key], capture_output=True,
                          text=True, timeout=120, check=True, cwd=ROOT)
    return done.stdout.strip().splitlines()[-1]


def test_a_dead_address_costs_misses_never_an_exception(tmp_path: Path) -> None:
    """Nothing listens: every call is a miss, counted; after the first failure the backend
    backs off and makes no pool calls."""
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    url = node.url
    node.stop()
    args = {"layout": "page_first", "page_size": 16, "pages": 8}
    run = driver(tmp_path, [
        {"do": "backend", "name": "a", "pool": "a", "url": url, "extra": {"timeout_s": 1.0},
         **args},
        {"do": "exists", "name": "a", "keys": KEYS[:4]},
        {"do": "get", "name": "a", "keys": KEYS[:4], "pages": [0, 1, 2, 3]},
        {"do": "set", "name": "a", "keys": KEYS[:4], "pages": [0, 1, 2, 3]},
    ])
    made, found, got, stored = results(run)
    assert made["made"]
    assert found == 0 and got == [False] * 4 and stored == [False] * 4
    counters = run["counters"]["a"]
    # one pool call failed; the two after it were not made (no time spent on them)
    assert counters["errors"] == 1 and counters["backed_off"] == 2


def test_settings_fail_with_one_clear_line(tmp_path: Path) -> None:
    run = driver(tmp_path, [
        {"do": "backend", "name": "a", "pool": "a", "url": "127.0.0.1:1",
         "extra": {"kvpool_urll": "x"}},
        {"do": "backend", "name": "b", "pool": "a", "url": "",
         "extra": {}},
        {"do": "backend", "name": "c", "pool": "a", "url": "127.0.0.1:1",
         "extra": {"timeout_s": 0}},
        {"do": "backend", "name": "d", "pool": "a", "url": "127.0.0.1:1",
         "extra": {"shm": "maybe"}},
    ])
    errors = [r["error"] for r in results(run)]
    assert "unknown extra config key(s) ['kvpool_urll']" in errors[0]
    assert 'needs "kvpool_url"' in errors[1]
    assert "timeout_s must be > 0" in errors[2]
    assert "shm must be true or false or null, got 'maybe' (str)" in errors[3]
    assert all("\n" not in e for e in errors)


def test_a_three_node_cluster_serves_every_page_with_a_node_killed(tmp_path: Path) -> None:
    args = {"layout": "page_first", "page_size": 16, "pages": 8}
    with LocalCluster(3, replication=2, data_dir=tmp_path / "c3",
                      serve_args=["--no-ssd", "--dram-capacity", "128MiB"]) as cluster:
        seeds = ",".join(cluster.seeds)
        victim = cluster.nodes[1].proc
        assert victim is not None
        # b's client is connected to every node when the node dies: its next calls meet a
        # dead connection, not a node it already knows to be down
        run = driver(tmp_path, [
            {"do": "backend", "name": "a", "pool": "a", "url": seeds, **args},
            {"do": "fill", "pool": "a", "seed": 5},
            {"do": "set", "name": "a", "keys": KEYS, "pages": list(range(8))},
            {"do": "backend", "name": "b", "pool": "b", "url": seeds, **args},
            {"do": "exists", "name": "b", "keys": KEYS},
            {"do": "kill", "pid": victim.pid},
            {"do": "exists", "name": "b", "keys": KEYS},
            {"do": "get", "name": "b", "keys": KEYS, "pages": list(range(8))},
            {"do": "same", "a": "a", "b": "b", "pages": list(range(8))},
        ])
    _, _, stored, _, before, _, found, got, same = results(run)
    assert stored == [True] * 8 and before == 8
    assert found == 8 and got == [True] * 8 and same == [True] * 8


def test_a_node_killed_during_a_batch_costs_misses_never_wrong_bytes(tmp_path: Path) -> None:
    """A node of a 3-node cluster (replication 2) is SIGKILLed 5 ms into a 94 MB batch of
    64 pages over TCP (~50 ms here; whether it dies mid-batch depends on timing: the
    checks hold either way): the batch returns, each page it calls loaded is bit-exact,
    and the next batch loads every page from the replicas. (Measured 3 times by hand:
    64 of 64 loaded by the first batch, in 47-55 ms.)"""
    big = {"layout": "page_first", "page_size": 64, "pages": 64,
           "geometry": {"layers": 30, "heads": 3, "dim": 64}}  # pages of 1.47 MB
    keys = [f"big-{i:02d}" for i in range(64)]
    pages = list(range(64))
    with LocalCluster(3, replication=2, data_dir=tmp_path / "c3",
                      serve_args=["--no-ssd", "--dram-capacity", "512MiB"]) as cluster:
        seeds = ",".join(cluster.seeds)
        victim = cluster.nodes[0].proc
        assert victim is not None
        run = driver(tmp_path, [
            {"do": "backend", "name": "a", "pool": "a", "url": seeds, **big},
            {"do": "fill", "pool": "a", "seed": 9},
            {"do": "set", "name": "a", "keys": keys, "pages": pages},
            # over TCP, as from another host (a same-host reader may still copy, verified,
            # from a dead node's shared memory)
            {"do": "backend", "name": "b", "pool": "b", "url": seeds, "extra": {"shm": False},
             **big},
            {"do": "exists", "name": "b", "keys": keys},
            {"do": "kill", "pid": victim.pid, "after": 0.005},
            {"do": "get", "name": "b", "keys": keys, "pages": pages},
            {"do": "same", "a": "a", "b": "b", "pages": pages},
            {"do": "get", "name": "b", "keys": keys, "pages": pages},
            {"do": "same", "a": "a", "b": "b", "pages": pages},
        ], timeout=300)
    steps = run["steps"]
    stored, found = steps[2]["result"], steps[4]["result"]
    got, same = steps[6]["result"], steps[7]["result"]
    assert stored == [True] * 64 and found == 64
    assert all(s for g, s in zip(got, same, strict=True) if g), (got, same)
    # (a hang on the dead node would end the driver at its timeout: the bound, not a clock)
    assert steps[8]["result"] == [True] * 64 and steps[9]["result"] == [True] * 64


@pytest.mark.parametrize("lie", ["hello", "lookup", "get"])
def test_a_lying_node_costs_misses_never_an_exception(tmp_path: Path, lie: str) -> None:
    """A node whose HELLO says max_batch 0, whose LOOKUP claims 1000 of 4 pages, or whose
    GET reply has an item too many: SGLang gets misses (never more pages than it asked
    about), never an exception, from the v1 and the older calls alike."""
    liar = LyingNode()
    args = {"layout": "page_first", "page_size": 16, "pages": 8}
    try:
        driver(tmp_path, [
            {"do": "backend", "name": "a", "pool": "a", "url": liar.url, **args},
            {"do": "fill", "pool": "a", "seed": 5},
            {"do": "set", "name": "a", "keys": KEYS[:4], "pages": [0, 1, 2, 3]},
        ])
        liar.tamper = {"hello": only(Op.HELLO, lambda _op, r: hello_with(r, max_batch=0)),
                       "lookup": only(Op.LOOKUP, claims_1000),
                       "get": only(Op.GET, one_more_item)}[lie]
        run = driver(tmp_path, [
            {"do": "backend", "name": "b", "pool": "b", "url": liar.url,
             "extra": {"timeout_s": 2.0}, **args},
            {"do": "exists", "name": "b", "keys": KEYS[:4]},
            {"do": "get", "name": "b", "keys": KEYS[:4], "pages": [0, 1, 2, 3]},
            {"do": "get_flat", "name": "b", "keys": KEYS[:2], "pages": [0, 1]},
        ])
    finally:
        liar.close()
    made, found, got, flat = results(run)
    assert made["made"]
    assert 0 <= found <= 4
    if lie != "get":
        assert found == 0  # the lie itself, or no HELLO: no page promised
    if lie != "lookup":
        assert got == [False] * 4 and flat == [False, False]
    assert run["counters"]["b"]["errors"] >= 1


def test_fuzzed_replies_cost_misses_never_an_exception(tmp_path: Path) -> None:
    """After four pages are stored, the node rewrites half its replies at random (up to 40
    seeded lies: a byte, a cut, an extension, the header's count, length, status or op)
    while SGLang asks 15 times which of 4 pages exist, loads them and compares them with
    the pages stored: every answer is within what was asked, every page loaded is
    bit-exact, and nothing raises. (A lie that leaves the client waiting costs a timeout,
    after which the client leaves the node alone for ten of them: later rounds miss.)"""
    liar = LyingNode(close_after_lie=True)
    tamper = HalfLies(49)  # lies at seed 49, the coin at 50

    args = {"layout": "page_first", "page_size": 16, "pages": 8}
    pages = [0, 1, 2, 3]
    try:
        driver(tmp_path, [
            {"do": "backend", "name": "a", "pool": "a", "url": liar.url, **args},
            {"do": "fill", "pool": "a", "seed": 6},
            {"do": "set", "name": "a", "keys": KEYS[:4], "pages": pages},
        ])
        liar.tamper = tamper
        steps: list[dict[str, Any]] = [
            {"do": "pool", "pool": "a", **args},  # the stored pages again, no backend
            {"do": "fill", "pool": "a", "seed": 6},
            {"do": "backend", "name": "b", "pool": "b", "url": liar.url,
             "extra": {"timeout_s": 2.0, "retry_after_s": 0.01}, **args},
        ]
        for _ in range(15):
            steps += [{"do": "exists", "name": "b", "keys": KEYS[:4]},
                      {"do": "get", "name": "b", "keys": KEYS[:4], "pages": pages},
                      {"do": "same", "a": "a", "b": "b", "pages": pages},
                      {"do": "sleep", "seconds": 0.15}]  # past the back-off (at most 12x)
        run = driver(tmp_path, steps)
    finally:
        liar.close()
    made = results(run)[2]
    assert made["made"] and tamper.told > 0, (made, tamper.replies)
    rounds = [results(run)[i:i + 3] for i in range(3, len(steps), 4)]
    assert all(0 <= found <= 4 for found, _, _ in rounds), rounds
    for found, got, same in rounds:  # a page reported loaded holds the stored bytes
        assert all(s for g, s in zip(got, same, strict=True) if g), (found, got, same)
    assert any(found == 4 and all(got) for found, got, _ in rounds), (rounds, tamper.told)
    assert run["counters"]["b"]["errors"] >= 1
