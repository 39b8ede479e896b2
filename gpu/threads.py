"""Background threads of the engine adapters, and how they yield the CPU to the engine."""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["nicer"]

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
