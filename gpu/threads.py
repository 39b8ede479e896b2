"""Background threads of the engine adapters, and how they yield the CPU to the engine."""

from __future__ import annotations

import glob
import logging
import os
import threading

__all__ = ["cpus_for_io", "move_to", "nicer", "parse_cpus", "spare_cpus"]

log = logging.getLogger("kvpool.gpu")


def nicer(by: int) -> None:
    """Make the calling thread ``by`` nicer than it is (at most 19), where the OS has a
    niceness per thread (Linux; elsewhere a no-op, logged): where kvpool's background
    threads share cores with the engine's, the scheduler runs the engine's first. The
    threads this one starts later inherit it. (``python -m bench.save_nice``: on the
    2-core VM a saving thread beside a one-thread torch loop took the loop's step p99
    from 1.4 to 5.9 ms at the same niceness, 1.6 ms at +10; docs/vllm.md.)"""
    if not by:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (AttributeError, OSError) as exc:  # no per-thread niceness here
        log.info("kvpool: a background thread stays at the engine's priority: %s", exc)


def parse_cpus(text: str) -> set[int]:
    """A CPU list as Linux writes one (``"0,2-3"``); ValueError if it is not one."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"bad CPU range {part!r}")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(low, high + 1))
    if not cpus:
        raise ValueError(f"no CPU in {text!r}")
    return cpus


def _numa_cpus() -> list[set[int]]:
    """Each NUMA node's CPUs (Linux sysfs; empty where it cannot be read)."""
    nodes = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist")):
        try:
            with open(path) as f:
                nodes.append(parse_cpus(f.read().strip()))
        except (OSError, ValueError):
            continue
    return nodes


def spare_cpus() -> set[int]:
    """The CPUs of the calling thread's NUMA nodes it may not run on (empty: none, or no
    affinity on this OS). vLLM's CPU build binds each worker's OpenMP threads, the worker's
    own thread among them, to CPUs of their own and leaves the rest of the node to its
    front end: a thread the worker starts inherits the binding, so kvpool's loads and saves
    ran on the very CPU the forward pass computes on."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    bound = os.sched_getaffinity(0)
    nodes = [cpus for cpus in _numa_cpus() if cpus & bound]
    near = set().union(*nodes) if nodes else set(range(os.cpu_count() or 0))
    return near - bound


def cpus_for_io(setting: str, engine_on_cpu: bool) -> set[int]:
    """Where the connector's I/O threads run (called on the engine's thread), from its
    ``io_cpus`` setting: ``"auto"``, on a CPU engine, the spare CPUs next to the engine's
    (:func:`spare_cpus`); ``"engine"`` (and ``"auto"`` on a GPU, or with none spare):
    wherever the engine's thread may run (empty set: no move); else a CPU list."""
    if setting == "engine" or (setting == "auto" and not engine_on_cpu):
        return set()
    if setting == "auto":
        return spare_cpus()
    return parse_cpus(setting)


def move_to(cpus: set[int]) -> None:
    """Run the calling thread (and the threads it starts later) on ``cpus``; where the OS
    refuses (none of them allowed here, or no affinity on this OS) it stays, logged."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError) as exc:
        log.warning("kvpool: a background thread stays on the engine's CPUs (could not move "
                    "it to %s: %s)", ",".join(map(str, sorted(cpus))), exc)
