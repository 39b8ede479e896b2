"""The scheduler side of kvpool's vLLM connector (vLLM's EngineCore process): how many
tokens the pool holds for a request, what the worker loads and saves each step, which
finished requests' blocks stay held for a save."""

from __future__ import annotations

import logging
import time
from typing import Any

from kvpool.client import Client, KvpoolError
from kvpool.gpu._vllm_state import (
    ConnectorState,
    KvpoolConnectorMetadata,
    KvpoolHandshake,
    _Load,
    _Request,
    _Save,
    _usable,
)
from kvpool.placement.keys import ChunkHasher, Namespace

__all__ = ["SchedulerSide"]

log = logging.getLogger("kvpool.vllm")


class SchedulerSide:
    def __init__(self, state: ConnectorState) -> None:
        self.state = state
        self._client: Client | None = None
        self._matched: dict[str, int] = {}
        self._loads: dict[str, _Load] = {}
        self._requests: dict[str, _Request] = {}
        #: requests whose save was asked of the worker: their blocks are held when they
        #: finish until the worker reports the save done (``get_finished``)
        self._save_issued: set[str] = set()
        #: waiting requests' lookups: (when, tokens asked, chunks found), reused for
        #: ``lookup_reuse_s`` (vLLM asks at every step a request waits for blocks)
        self._found: dict[str, tuple[float, int, int]] = {}

    def _pool(self) -> Client:
        if self._client is None:
            self._client = self.state.settings.client()
        return self._client

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` the pool holds (full chunks, leaving the last
        prompt token to compute), and whether they load asynchronously; one lookup round
        trip, no side effect on the pool."""
        state, data = self.state, self.state.stats.data
        if not state.load_enabled:
            return 0, False
        if not _usable(request):
            data["skipped"] += 1
            return 0, False
        chunk = state.chunk_tokens
        tokens = request.prompt_token_ids
        limit = (len(tokens) - 1) // chunk * chunk
        if limit <= num_computed_tokens:
            return 0, False
        if not state.backoff.allow():
            data["backed_off"] += 1
            return 0, False
        found = self._reused(request.request_id, limit)
        asked = found is None
        if found is None:
            data["lookups"] += 1
            data["tokens_looked_up"] += limit
            try:
                found = self._pool().lookup(state.hasher.keys(tokens[:limit]))
            except KvpoolError as exc:
                data["lookup_errors"] += 1
                state.once("lookup", "lookup failed, treating it as a miss: %s", exc)
                state.failed("lookup")
                return 0, False
            state.backoff.succeeded()
            if state.settings.lookup_reuse_s > 0:
                self._found[request.request_id] = (time.monotonic(), limit, found)
        # never more than was asked, whatever a node said (the client checks it too)
        hit = min(found, limit // chunk) * chunk
        if asked:  # (a reused answer is counted once, beside the tokens looked up)
            data["tokens_hit"] += hit
        if hit <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        return hit - num_computed_tokens, state.settings.load_mode == "async"

    def _reused(self, request_id: str, limit: int) -> int | None:
        """The chunks a lookup of this waiting request found, if it asked for the same
        tokens within ``lookup_reuse_s`` (None: ask the pool)."""
        seen = self._found.get(request_id)
        if seen is None:
            return None
        when, asked, found = seen
        if asked != limit or time.monotonic() - when > self.state.settings.lookup_reuse_s:
            del self._found[request_id]
            return None
        self.state.stats.data["lookups_reused"] += 1
        return found

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM gave ``request`` its blocks: the promised tokens become a load (a later
        ask, after a preemption, looks up anew)."""
        self._found.pop(request.request_id, None)
        if num_external_tokens <= 0:
            return
        start = self._matched.pop(request.request_id, 0)
        end = start + num_external_tokens
        self._loads[request.request_id] = _Load(
            request.request_id, list(request.prompt_token_ids[:end]),
            list(blocks.get_block_ids()[0]), start, end)

    def step(self, scheduler_output: Any) -> KvpoolConnectorMetadata:
        """What the worker does this step: the loads vLLM scheduled, the saves of
        prefills completing in it, the saves to finish before preempted blocks are
        written again."""
        meta = KvpoolConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids is None:
                continue
            state = _Request(list(new.prompt_token_ids), list(new.block_ids[0]),
                             usable=not (new.mm_features or new.lora_request))
            self._requests[new.req_id] = state
            self._add_load(meta, new.req_id, state)
            self._maybe_save(meta, new.req_id, state,
                             new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            known = self._requests.get(req_id)
            if known is None:
                continue
            state = known
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                if new_ids is not None:  # a resumed request gets all of its blocks anew
                    state.block_ids = list(new_ids[0])
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._add_load(meta, req_id, state)
            self._maybe_save(meta, req_id, state,
                             cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        if self.state.settings.load_mode == "async":
            # the request waits (WAITING_FOR_REMOTE_KVS) until the worker reports its load
            # done; it is scheduled afterwards with the blocks it was given now
            meta.loads.extend(self._loads.values())
        self._loads.clear()  # a load not scheduled this step was never started
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        meta.flush = {req_id for req_id in preempted if req_id in self._save_issued}
        return meta

    def _add_load(self, meta: KvpoolConnectorMetadata, req_id: str, state: _Request) -> None:
        load = self._loads.pop(req_id, None)
        if load is not None:
            load.block_ids = list(state.block_ids)
            meta.loads.append(load)

    def _maybe_save(self, meta: KvpoolConnectorMetadata, req_id: str, state: _Request,
                    computed: int) -> None:
        """Save the prompt's full chunks in the step its prefill completes."""
        if state.saved or computed < len(state.prompt):
            return
        state.saved = True
        chunk = self.state.chunk_tokens
        full = len(state.prompt) // chunk * chunk
        if self.state.save_enabled and state.usable and full:
            meta.saves.append(_Save(req_id, state.prompt[:full], list(state.block_ids)))
            self._save_issued.add(req_id)

    def failed_blocks(self, invalid: set[int]) -> None:
        """Blocks the worker failed to load are recomputed: their request saves again once
        its prefill is complete anew (the worker did not save past a failed block)."""
        for state in self._requests.values():
            if state.saved and not invalid.isdisjoint(state.block_ids):
                state.saved = False

    def finished(self, request_id: str) -> bool:
        """True (hold the blocks) if a save of the request was asked: the worker reads them
        off the step and reports the save done through ``get_finished``."""
        for table in (self._requests, self._loads, self._matched, self._found):
            table.pop(request_id, None)
        saving = request_id in self._save_issued
        self._save_issued.discard(request_id)
        return saving

    def adopt(self, handshake: KvpoolHandshake) -> None:
        """Hash with the worker's namespace; promise nothing if its connector is disabled
        (each promise would be a failed load)."""
        state = self.state
        if handshake.namespace is None:
            if state.load_enabled or state.save_enabled:
                log.error("kvpool connector: the worker's connector is disabled (see its "
                          "log): no loads promised, no saves asked")
            state.load_enabled = state.save_enabled = False
            return
        namespace = Namespace(**handshake.namespace)
        if namespace != state.namespace:
            log.info("kvpool connector: keys of the worker's namespace %s", namespace)
            state.namespace = namespace
            state.hasher = ChunkHasher(namespace)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
