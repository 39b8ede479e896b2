"""A thread pool that runs the work given for one key in the order it was given, and work
on different keys in parallel: the SSD worker's S3 calls (an upload, then a DELETE of
the same key, must reach S3 in that order)."""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["KeyedPool"]

_Work = tuple[Callable[..., object], tuple[Any, ...]]


class KeyedPool:
    """``workers`` threads named ``name``; a failed call is printed to stderr (the node
    logs the worker's stderr) and the work behind it still runs."""

    def __init__(self, workers: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        #: per key with work in flight, the work queued behind it
        self._queues: dict[bytes, deque[_Work]] = {}

    def busy(self, key: bytes) -> bool:
        """Work on ``key`` is queued or running."""
        with self._lock:
            return key in self._queues

    def submit(self, key: bytes, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` once the work given before it for ``key`` is done."""
        with self._lock:
            queue = self._queues.get(key)
            if queue is not None:
                queue.append((fn, args))
                return
            self._queues[key] = deque()
        self._pool.submit(self._run, key, fn, args)

    def _run(self, key: bytes, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        while True:
            try:
                fn(*args)
            except Exception as exc:  # keep going: the work behind it still has to run
                print(f"kvpool ssd worker: S3: {type(exc).__name__}: {exc}", file=sys.stderr)
            with self._lock:
                queue = self._queues[key]
                if not queue:
                    del self._queues[key]
                    return
                fn, args = queue.popleft()

    def shutdown(self, *, drop_queued: bool = True) -> None:
        """Wait for the running calls, and drop the keys' work not started yet (or, with
        ``drop_queued=False``, wait for it too)."""
        self._pool.shutdown(wait=True, cancel_futures=drop_queued)
