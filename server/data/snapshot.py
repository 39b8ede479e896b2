"""The node's stats snapshot: what STATS answers and ``/stats`` shows, from the data path's
counters, the tiers' snapshot and the services' sections (``extra_stats``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from kvpool.protocol.frames import PROTOCOL_VERSION
from kvpool.server.admin.events import EventBus
from kvpool.server.cold.tiering import TierManager
from kvpool.server.data.stats import NodeStats
from kvpool.server.security.auth import TokenTable

__all__ = ["Counted", "node_snapshot"]


class Counted(Protocol):
    """What the snapshot reads of the node's op table (``handlers.Handlers``)."""

    node_id: str
    store: TierManager
    auth: TokenTable
    events: EventBus
    stats: NodeStats
    started_at: float
    wrong_owner: int
    auth_failures: int
    extra_stats: dict[str, Callable[[], Any]]

    @property
    def epoch(self) -> int: ...


async def node_snapshot(handlers: Counted) -> dict[str, Any]:
    """Everything a node counts, as one JSON-able dict."""
    store = await handlers.store.snapshot()
    dram = store["tiers"]["dram"]  # the tiers' snapshot has DRAM's counters already
    auth, events = handlers.auth, handlers.events
    return {
        "node_id": handlers.node_id,
        "protocol": PROTOCOL_VERSION,
        "uptime_s": round(time.time() - handlers.started_at, 3),
        "capacity_bytes": dram["capacity_bytes"],
        "used_bytes": dram["used_bytes"],
        "num_objects": dram["num_objects"],
        "evictions": dram["evictions"],
        "promotions": store["promotions"],
        "cluster_epoch": handlers.epoch,
        "wrong_owner": handlers.wrong_owner,
        "auth": {"mode": "open" if auth.open else "tokens",
                 "tokens": len(auth.entries), "failures": handlers.auth_failures,
                 "quota_evictions": store["quota_evictions"],
                 "quota_rejections": store["quota_rejections"],
                 "ssd_quota_evictions": store["ssd_quota_evictions"]},
        "events": {"subscribers": len(events.subscribers), "published": events.published,
                   "lost": events.lost, "dropped": events.dropped},
        "tiers": store["tiers"],
        **handlers.stats.to_dict(),
        **{name: fn() for name, fn in handlers.extra_stats.items()},
    }
