"""kvpool node process: data-path TCP server, tiers, admin HTTP, config, CLI. No torch."""

from kvpool.server.config import DramConfig, NodeConfig, ServerConfig, load_config
from kvpool.server.node import Node, run_node

__all__ = ["DramConfig", "Node", "NodeConfig", "ServerConfig", "load_config", "run_node"]
