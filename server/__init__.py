"""kvpool node process: data-path TCP server, tiers, admin HTTP, config. No torch.

``Node`` and ``run_node`` load on first use, so the configuration (``kvpool.server.config``)
imports with the SDK's dependencies only: the command line reads it to describe ``serve``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpool.server.config import DramConfig, NodeConfig, ServerConfig, load_config

if TYPE_CHECKING:
    from kvpool.server.node import Node
    from kvpool.server.run import run_node

__all__ = ["DramConfig", "Node", "NodeConfig", "ServerConfig", "load_config", "run_node"]


def __getattr__(name: str) -> Any:
    if name == "Node":
        from kvpool.server.node import Node

        return Node
    if name == "run_node":
        from kvpool.server.run import run_node

        return run_node
    raise AttributeError(f"module 'kvpool.server' has no attribute {name!r}")
