"""How long rocksdict calls hold the GIL: the reason the SSD tier runs in its own process.

    python -m bench.rocksdict_gil

A background thread loops on one rocksdict call while the main thread spins and
records the longest gap between its iterations; an idle baseline is measured the
same way. Prints a table and writes ``bench/results/rocksdict_gil.json``.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import rocksdict


def longest_stall(op: Callable[[int], object], seconds: float) -> dict[str, float]:
    stop = threading.Event()
    count = [0]

    def loop() -> None:
        while not stop.is_set():
            op(count[0])
            count[0] += 1

    thread = threading.Thread(target=loop)
    thread.start()
    gaps = []
    last = time.perf_counter()
    end = last + seconds
    while last < end:
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        sum(range(200))
    stop.set()
    thread.join()
    gaps.sort()
    return {"max_ms": gaps[-1] * 1e3, "p99_99_ms": gaps[int(len(gaps) * 0.9999)] * 1e3,
            "ops": count[0]}


def _get_one(db: rocksdict.Rdict, keys: list[bytes]) -> Callable[[int], object]:
    return lambda i: db.get(keys[i % len(keys)])


def _get_list(db: rocksdict.Rdict, keys: list[bytes]) -> Callable[[int], object]:
    return lambda i: db.get([keys[i % len(keys)]])


def _put(db: rocksdict.Rdict, value: bytes) -> Callable[[int], object]:
    return lambda i: db.put(i.to_bytes(16, "big"), value)


def main() -> None:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-gil-") as path:
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_compression_type(rocksdict.DBCompressionType.none())
        db = rocksdict.Rdict(path, opts)
        for size in (4 << 20, 16 << 20):
            value = os.urandom(size)
            keys = [os.urandom(16) for _ in range(4)]
            for k in keys:
                db.put(k, value)
            label = f"{size >> 20} MiB"
            results[f"idle ({label} run)"] = longest_stall(lambda _i: time.sleep(0.001), 1.5)
            results[f"get(key), {label}"] = longest_stall(_get_one(db, keys), 1.5)
            results[f"get([key]), {label}"] = longest_stall(_get_list(db, keys), 1.5)
            results[f"put, {label}"] = longest_stall(_put(db, value), 2.0)
        db.close()
    print("| background call | main thread's longest stall ms | p99.99 ms | calls |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['max_ms']:.1f} | {r['p99_99_ms']:.2f} | {r['ops']} |")
    out = Path("bench/results/rocksdict_gil.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
