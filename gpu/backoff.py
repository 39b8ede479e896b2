"""Leaving a failing pool alone for a while: what engine adapters do after a failed call."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Backoff"]


class Backoff:
    """After a failure, :meth:`allow` is False for ``first`` seconds, doubling with each
    failure in a row up to ``12 * first``; a success resets it. An engine adapter keeps
    one per process side (a scheduler, a worker): a hung node then costs the engine one
    call's timeout per back-off, not one per request or step."""

    def __init__(self, first: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.first, self.clock = first, clock
        self.wait = 0.0  #: the current back-off, 0 while the pool answers
        self.until = 0.0

    def allow(self) -> bool:
        return bool(self.clock() >= self.until)

    def failed(self) -> float:
        """Record a failure; the seconds the pool is now left alone."""
        self.wait = min(12 * self.first, 2 * self.wait) if self.wait else self.first
        self.until = self.clock() + self.wait
        return self.wait

    def succeeded(self) -> None:
        self.wait = self.until = 0.0
