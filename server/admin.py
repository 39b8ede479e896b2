"""The admin HTTP API (aiohttp): ``GET /healthz``, ``GET /v1/stats``, ``GET /v1/cluster``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

__all__ = ["make_admin_app"]


def make_admin_app(node_id: str, snapshot: Callable[[], Awaitable[dict[str, Any]]],
                   cluster: Callable[[], dict[str, Any]]) -> web.Application:
    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "node_id": node_id})

    async def stats(_request: web.Request) -> web.Response:
        return web.json_response(await snapshot())

    async def cluster_map(_request: web.Request) -> web.Response:
        return web.json_response(cluster())

    app = web.Application()
    app.router.add_get("/v1/cluster", cluster_map)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/stats", stats)
    return app
