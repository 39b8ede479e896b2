"""What both sides of kvpool's vLLM connector share: its settings, the messages between
the scheduler and the worker (metadata, handshake, counters), and :class:`ConnectorState`,
what both read of the engine and the pool."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvpool.client import Client
from kvpool.gpu._vllm_layout import _layout, _namespace, _tp_rank
from kvpool.gpu.backoff import Backoff
from kvpool.gpu.connector import DEFAULT_STAGING_SLOTS
from kvpool.gpu.layout import KVLayout
from kvpool.gpu.settings import settings_from
from kvpool.gpu.threads import parse_cpus
from kvpool.placement.keys import DEFAULT_CHUNK_TOKENS, ChunkHasher
from kvpool.protocol.errors import ConfigError

__all__ = ["ConnectorState", "KvpoolConnectorMetadata", "KvpoolConnectorStats",
           "KvpoolHandshake", "KvpoolSettings", "default_model_id"]

log = logging.getLogger("kvpool.vllm")


def _log_where_vllm_logs() -> None:
    """kvpool's lines (the connector's start line, a node marked down) where vLLM prints
    its own, in its format: vLLM configures its ``vllm`` logger only, so under ``vllm
    serve`` kvpool's INFO lines went nowhere. Left alone where the application gave the
    ``kvpool`` logger a handler, or vLLM's logging is off (``VLLM_CONFIGURE_LOGGING=0``)."""
    ours, theirs = logging.getLogger("kvpool"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False  # (a root handler would print each line twice)


_LOAD_MODES = ("async", "sync", "layer")
_CHUNK_FORMATS = ("canonical", "engine")


@dataclass(frozen=True, slots=True)
class KvpoolSettings:
    """``kv_connector_extra_config``; only ``kvpool_url`` is needed."""

    #: a node URL, or a comma-separated seed list (``kvpool://`` optional)
    kvpool_url: str
    #: the tenant token (default: ``$KVPOOL_TOKEN``)
    token: str | None = None
    #: "tenant" (the token's own), "shared" (readable by every tenant) or "raw"
    scope: str = "tenant"
    #: tokens per chunk: a multiple of vLLM's block size; engines that share chunks agree
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    #: the model in the key namespace (default: :func:`default_model_id`)
    model_id: str = ""
    #: seconds a pool call may take before it is a miss (the engine never waits longer)
    timeout_s: float = 5.0
    #: after a pool call fails, the pool is left alone this long (doubling while it keeps
    #: failing, up to 12x): each call to a hung node would cost the engine ``timeout_s``
    retry_after_s: float = 5.0
    #: "async", "sync" or "layer" (see the module doc)
    load_mode: str = "async"
    #: chunks in flight at once per load or save
    staging_slots: int = DEFAULT_STAGING_SLOTS
    #: chunks queued or being saved at once; a save past it is skipped (counted as
    #: ``saves_skipped``): a pool that falls behind costs cache hits, never memory or time
    save_queue_chunks: int = 256
    #: niceness the save threads add to the engine thread's (Linux; 0 to 19; 0: none):
    #: where saves share cores with the engine, the OS runs the engine's threads first
    #: (docs/vllm.md has what it did and did not do; loads are never lowered: a request
    #: waits for them)
    save_nice: int = 0
    #: where the load and save threads run (Linux): "auto" (on vLLM's CPU build, the CPUs
    #: of the worker's NUMA node that its OpenMP threads are not bound to, the ones vLLM
    #: leaves its front end; on a GPU, or with none spare, the engine thread's), "engine"
    #: (the engine thread's CPUs, as the threads it starts inherit), or a CPU list ("2,3")
    io_cpus: str = "auto"
    #: seconds the scheduler reuses a waiting request's lookup: vLLM asks again at every
    #: step a request waits for blocks, and each ask would be a round trip on the
    #: scheduler's step (0: ask every time; counted as ``lookups_reused``)
    lookup_reuse_s: float = 1.0
    #: same-host shared memory: None = when the node offers it
    shm: bool | None = None
    #: "canonical" (engine-neutral chunks: any engine reads them) or "engine" (vLLM
    #: CPU_ATTN's own block bytes: no conversion, loads straight into the blocks, but
    #: only vLLM CPU engines with the same block size share them)
    chunk_format: str = "canonical"

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> KvpoolSettings:
        """ConfigError naming the bad key (vLLM then fails at start with that line)."""
        settings = settings_from(
            cls, extra, owner="kvpool connector", keys="kv_connector_extra_config key(s)",
            missing_url='kv_connector_extra_config needs "kvpool_url" '
                        '(e.g. "kvpool://127.0.0.1:7700")')
        if settings.chunk_format not in _CHUNK_FORMATS:
            raise ConfigError(f"kvpool connector: chunk_format must be one of "
                              f"{_CHUNK_FORMATS}, got {settings.chunk_format!r}")
        if settings.load_mode not in _LOAD_MODES:
            raise ConfigError(f"kvpool connector: load_mode must be one of {_LOAD_MODES}, got "
                              f"{settings.load_mode!r}")
        if settings.lookup_reuse_s < 0:
            raise ConfigError(f"kvpool connector: lookup_reuse_s must be >= 0, got "
                              f"{settings.lookup_reuse_s!r}")
        if not isinstance(settings.save_nice, int) or not 0 <= settings.save_nice <= 19:
            raise ConfigError(f"kvpool connector: save_nice must be an integer from 0 to "
                              f"19, got {settings.save_nice!r}")
        if settings.io_cpus not in ("auto", "engine"):
            try:
                parse_cpus(str(settings.io_cpus))
            except ValueError as exc:
                raise ConfigError(f"kvpool connector: io_cpus must be \"auto\", \"engine\" or "
                                  f"a CPU list such as \"2,3\" or \"4-7\", got "
                                  f"{settings.io_cpus!r} ({exc})") from None
        for name in ("chunk_tokens", "staging_slots", "save_queue_chunks"):
            value = getattr(settings, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"kvpool connector: {name} must be an integer >= 1, got "
                                  f"{value!r}")
        return settings

    def client(self) -> Client:
        return Client(self.kvpool_url, token=self.token,  # one node, or comma-separated seeds
                      scope=self.scope, shm=self.shm,
                      timeout=self.timeout_s, connect_timeout=min(2.0, self.timeout_s),
                      client_name="kvpool-vllm")


def default_model_id(config: Any, name_or_path: str = "") -> str:
    """The model id a namespace records for ``config`` (a transformers config): its
    ``kvpool_model_id`` attribute if the model folder's config.json has one (the SmolLM2
    folder of :func:`kvpool.examples.models.load_smollm2` does), else ``name_or_path``. The
    transformers adapter uses the same rule, so the two engines share chunks."""
    return str(getattr(config, "kvpool_model_id", None) or name_or_path
               or getattr(config, "name_or_path", "") or "")


@dataclass
class _Load:
    req_id: str
    tokens: list[int]  #: the prompt up to ``end``
    block_ids: list[int]
    start: int  #: tokens vLLM computed itself (its prefix cache): not written
    end: int  #: load up to here


@dataclass
class _Save:
    req_id: str
    tokens: list[int]  #: the prompt's full chunks
    block_ids: list[int]


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the worker does this step: loads (before the forward, or between steps with
    ``load_mode="async"``), saves (after it, off the step), and the preempted requests
    whose saves must finish before their blocks are written again."""

    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)
    flush: set[str] = field(default_factory=set)


@dataclass
class KvpoolHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells the scheduler at start (vLLM's handshake, before any request):
    the key namespace its chunks are stored under (``Namespace`` fields), which only the
    worker can know in full (its KV scales, the layers it was handed); None: its connector
    is disabled, so the scheduler promises no loads and asks no saves."""

    namespace: dict[str, Any] | None = None


_COUNTERS = ("lookups", "lookup_errors", "tokens_looked_up", "tokens_hit", "tokens_loaded",
             "tokens_stored", "load_errors", "save_errors", "load_s", "save_s", "skipped",
             "backed_off", "saves_skipped", "lookups_reused")


@dataclass
class KvpoolConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """The worker's counters since the last report (vLLM aggregates and logs them)."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(_COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KvpoolConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 4) if isinstance(value, float) else value
                for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class _Request:
    prompt: list[int]
    block_ids: list[int]
    #: False for requests whose token ids do not say what their KV is (see the module doc)
    usable: bool = True
    saved: bool = False


def _usable(request: Any) -> bool:
    """Whether the pool may serve ``request``: token ids, no multimodal input, no LoRA."""
    return not (getattr(request, "mm_features", None) or getattr(request, "lora_request", None)
                or getattr(request, "prompt_token_ids", None) is None)



class ConnectorState:
    """What the scheduler side and the worker side both read (each process has one; vLLM
    makes a connector in the scheduler's process and one in each worker's): the
    settings, what the engine's config says (block and chunk sizes, the layout and the
    key namespace, which the worker settles once it has seen its caches), whether loads
    and saves are on, the counters since vLLM's last report, and the pool's health as
    this process sees it."""

    def __init__(self, vllm_config: Any, transfer: Any) -> None:
        self.vllm_config = vllm_config
        self.settings = KvpoolSettings.from_extra_config(
            dict(transfer.kv_connector_extra_config or {}))
        self.block_size = int(vllm_config.cache_config.block_size)
        chunk = self.settings.chunk_tokens
        if chunk % self.block_size:
            raise ConfigError(f"kvpool connector: chunk_tokens ({chunk}) must be a multiple of "
                              f"vLLM's block size ({self.block_size}); set --block-size or "
                              "chunk_tokens")
        self.chunk_tokens = chunk
        self.load_enabled = bool(transfer.is_kv_consumer)
        self.save_enabled = bool(transfer.is_kv_producer)
        #: the paged layout the attention backend gives this engine's blocks (checked
        #: against the tensors when they are registered); None: not one mapped here
        self.layout: KVLayout | None = None
        try:  # both sides decide alike: the scheduler never promises what no worker loads
            self.layout = _layout(vllm_config, self.settings.chunk_format)
        except ConfigError as exc:
            log.error("kvpool connector: idle, every request computes its own KV: %s", exc)
            self.load_enabled = self.save_enabled = False
        model = vllm_config.model_config
        self.model_id = self.settings.model_id or default_model_id(model.hf_config,
                                                                   str(model.model))
        self.tp_rank = _tp_rank(vllm_config)
        #: canonical chunks are the same whatever the kind; the engine's own are not. The
        #: worker's is the final word: the scheduler takes it from vLLM's handshake
        self.namespace = _namespace(vllm_config, self.model_id, chunk, self.layout,
                                    self.tp_rank)
        self.hasher = ChunkHasher(self.namespace)
        self.stats = KvpoolConnectorStats()
        #: this process's view of the pool's health (scheduler: lookups; worker: I/O)
        self.backoff = Backoff(self.settings.retry_after_s)
        self._logged: set[str] = set()

    @property
    def active(self) -> bool:
        """A layout is mapped and loads or saves are on."""
        return self.layout is not None and (self.load_enabled or self.save_enabled)

    def once(self, what: str, message: str, *args: Any) -> None:
        """Log a failure the first time it happens (then it is only counted)."""
        if what not in self._logged:
            self._logged.add(what)
            log.warning("kvpool connector: " + message, *args)

    def failed(self, what: str) -> None:
        """A pool call failed: leave the pool alone for a while (logged each time)."""
        wait = self.backoff.failed()
        log.warning("kvpool connector: the pool failed a %s; no pool calls for %.0f s "
                    "(requests compute their own KV meanwhile)", what, wait)

    def take_stats(self) -> KvpoolConnectorStats | None:
        """The counters since the last call (None: nothing happened), and a fresh set."""
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KvpoolConnectorStats()
        return stats
