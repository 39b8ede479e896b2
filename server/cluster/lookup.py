"""A node's answer to an admin lookup (``/v1/lookup``): how many leading keys the pool
holds, and where. A standalone node reads its own tiers; a cluster member asks the
cluster as any client would (the SDK, seeded by the node itself)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpool.client import AsyncClient
from kvpool.server.cluster.membership import Membership

__all__ = ["ClusterLookup"]


def _prefix(codes: Sequence[int]) -> list[int]:
    """The leading codes up to the first miss (0)."""
    codes = list(codes)
    return codes[: codes.index(0)] if 0 in codes else codes


class ClusterLookup:
    """``local``: this node's tier code of each key (0: none holds it); ``address``:
    where the node serves (the SDK's seed); ``peer_options``: how it reaches its peers
    (token, scope, TLS)."""

    def __init__(self, membership: Membership, local: Callable[[Sequence[bytes]], Sequence[int]],
                 address: Callable[[], tuple[str, int]], peer_options: dict[str, Any]) -> None:
        self._membership = membership
        self._local = local
        self._address = address
        self._peer_options = peer_options
        self._peers: AsyncClient | None = None

    async def __call__(self, keys: Sequence[bytes]) -> list[int]:
        """Tier codes of the leading ``keys`` held anywhere in the cluster."""
        if self._membership.map is None:
            return _prefix(self._local(keys))
        if self._peers is None:
            host, port = self._address()
            self._peers = AsyncClient(f"kvpool://{host}:{port}", client_name="kvpool-node",
                                      shm=False, **self._peer_options)
        return _prefix(await self._peers.exists_codes(keys))

    async def close(self) -> None:
        if self._peers is not None:
            await self._peers.close()
