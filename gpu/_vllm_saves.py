"""The worker's saves, off the step: queued on a thread of their own (bounded: past
``save_queue_chunks`` a save is skipped and counted), a finished request reported once
its save is done, a preempted request's save finished before its blocks are written
again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvpool.client import KvpoolError
from kvpool.gpu._vllm_state import ConnectorState, _Save
from kvpool.gpu.connector import PagedKVConnector

__all__ = ["Saves"]


class Saves:
    """``io``: the save thread; ``saver``: the connector it drives (None: this worker
    saves nothing, as an MLA rank other than 0, or its connector failed to open);
    ``kernel_ids``: the caches' block ids of the scheduler's."""

    def __init__(self, state: ConnectorState, io: ThreadPoolExecutor | None,
                 saver: PagedKVConnector | None,
                 kernel_ids: Callable[[Sequence[int]], list[int]]) -> None:
        self.state = state
        self.io = io
        self.saver = saver
        self._kernel_ids = kernel_ids
        #: the latest save of each request still queued or running
        self._saving: dict[str, Future[None]] = {}
        #: requests whose save the scheduler asked for (it holds their blocks when they
        #: finish); and those finished, reported once their save is done
        self._owed: set[str] = set()
        self._finishing: set[str] = set()
        self._queued_chunks = 0
        self._lock = threading.Lock()

    def queue(self, saves: Sequence[_Save], valid_until: dict[str, int],
              engine_event: Callable[[], Any]) -> None:
        """Queue this step's saves and return: they read their blocks off the step.
        ``valid_until``: this step's requests whose load failed, the tokens valid before
        the failure (no save stores blocks a failed load left empty); ``engine_event``
        makes the event on the engine's stream the save thread waits for (CUDA; None
        elsewhere)."""
        self._owed.update(save.req_id for save in saves)
        if self.saver is None or self.io is None:
            return  # owed all the same: reported done when the request finishes
        after = engine_event()
        chunk = self.state.chunk_tokens
        limit = self.state.settings.save_queue_chunks
        for save in saves:
            tokens = save.tokens
            if save.req_id in valid_until:
                tokens = tokens[: valid_until[save.req_id] // chunk * chunk]
            chunks = len(tokens) // chunk
            if not chunks:
                continue
            with self._lock:
                if self._queued_chunks + chunks > limit:
                    self.state.stats.data["saves_skipped"] += 1
                    self.state.once("queue", "the pool is behind on saves (%d chunks "
                                    "queued): saves are skipped until it catches up",
                                    self._queued_chunks)
                    continue
                self._queued_chunks += chunks
            self._saving[save.req_id] = self.io.submit(
                self._save_one, tokens, save.block_ids, chunks, after)

    def flush(self, req_ids: Sequence[str] | set[str]) -> None:
        """Wait for the saves of ``req_ids`` still queued or running (preempted: their
        blocks are freed and may be written this step)."""
        for req_id in req_ids:
            saving = self._saving.get(req_id)
            if saving is not None:
                saving.result()  # _save_one never raises

    def done(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests (these and earlier ones) whose save is done: the scheduler
        frees their blocks."""
        owed = finished_req_ids & self._owed
        self._owed -= owed
        self._finishing |= owed
        for req_id, saving in list(self._saving.items()):
            if saving.done():
                del self._saving[req_id]
        sent = {req_id for req_id in self._finishing if req_id not in self._saving}
        self._finishing -= sent
        return sent

    def _save_one(self, tokens: list[int], block_ids: list[int], chunks: int,
                  after: Any) -> None:
        """On the save thread: store one request's full chunks (those the pool lacks);
        never raises."""
        assert self.saver is not None
        state = self.state  # (its stats are read at each count: vLLM takes them meanwhile)
        try:
            if after is not None:
                after.synchronize()  # the forward that wrote these blocks is done
            if not state.backoff.allow():
                state.stats.data["backed_off"] += 1
                return
            started = time.perf_counter()
            try:
                stored = self.saver.store(tokens, self._kernel_ids(block_ids))
                state.stats.data["tokens_stored"] += stored
                state.backoff.succeeded()
            except Exception as exc:  # a cache that missed a save is only a colder cache
                state.stats.data["save_errors"] += 1
                state.once("save", "a save failed (the pool just misses it): %s", exc)
                if isinstance(exc, KvpoolError):
                    state.failed("save")
            state.stats.data["save_s"] += time.perf_counter() - started
        finally:
            with self._lock:
                self._queued_chunks -= chunks
