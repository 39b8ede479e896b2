"""Summaries the benchmarks print (median [min-max]), and where their JSON goes."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

__all__ = ["RESULTS", "fmt", "save", "summary"]

RESULTS = Path(__file__).resolve().parent / "results"


def save(name: str, result: dict[str, Any]) -> Path:
    """``result`` and when it was measured, as ``bench/results/<name>.json``."""
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps({**result, "measured": time.strftime("%Y-%m-%d %H:%M:%S")},
                              indent=2))
    return out


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(s: dict[str, float] | None, unit: str = "", scale: float = 1.0) -> str:
    """``median [min-max]unit`` to 3 significant digits ("-" for no values)."""
    if s is None:
        return "-"
    return f"{s['median'] * scale:.3g} [{s['min'] * scale:.3g}-{s['max'] * scale:.3g}]{unit}"
