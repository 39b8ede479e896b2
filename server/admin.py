"""The admin HTTP API (aiohttp).

``GET /healthz``, ``GET /v1/stats``, ``GET /v1/cluster``, ``POST
/v1/cluster/join|drain|remove`` (etcd clusters), and ``POST /v1/lookup``:
how many leading tokens of a prompt the whole cluster holds, for callers
that are not Python. Errors are JSON with one shape:
``{"error": {"type": "bad_request", "message": "..."}}``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, Protocol

from aiohttp import web

from kvpool.placement.cluster_map import ClusterMap
from kvpool.placement.keys import ChunkHasher, Namespace, key_from_hex
from kvpool.protocol.errors import ConfigError, InvalidKeyError, KvpoolError
from kvpool.protocol.frames import Tier
from kvpool.server.events import EVENT_TYPES, EventBus
from kvpool.server.membership import StaticMapError
from kvpool.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

__all__ = ["MAX_LOOKUP_TOKENS", "make_admin_app"]

#: the most tokens (or keys) one lookup may carry: 4M tokens is ~16 MiB of JSON
MAX_LOOKUP_TOKENS = 1 << 22
_TIER_NAMES = {int(t): t.name.lower() for t in Tier}
#: seconds between SSE comment lines on an idle event stream (keeps proxies from timing out)
SSE_HEARTBEAT_S = 15.0


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message}}, status=status)


def _parse_lookup(body: Any) -> tuple[list[bytes], int | None]:
    """The keys to look up, and the chunk size when the request gave tokens."""
    if not isinstance(body, dict):
        raise ConfigError("the body must be a JSON object with 'keys' or 'namespace'+'tokens'")
    if "keys" in body:
        if set(body) != {"keys"}:
            raise ConfigError("give either 'keys' alone or 'namespace' and 'tokens'")
        keys = body["keys"]
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ConfigError("'keys' must be a list of 32-hex-character strings")
        if len(keys) > MAX_LOOKUP_TOKENS:
            raise ConfigError(f"at most {MAX_LOOKUP_TOKENS} keys per lookup")
        return [key_from_hex(k) for k in keys], None
    if set(body) != {"namespace", "tokens"}:
        raise ConfigError("give either 'keys' alone or 'namespace' and 'tokens'")
    ns, tokens = body["namespace"], body["tokens"]
    if not isinstance(ns, dict):
        raise ConfigError("'namespace' must be an object of Namespace fields")
    if not isinstance(tokens, list) or len(tokens) > MAX_LOOKUP_TOKENS:
        raise ConfigError(f"'tokens' must be a list of at most {MAX_LOOKUP_TOKENS} token ids")
    if not all(type(t) is int and 0 <= t < 1 << 32 for t in tokens):
        raise ConfigError("every token must be an integer in [0, 2**32)")
    try:
        namespace = Namespace(**ns)
    except TypeError as exc:
        raise ConfigError(f"bad namespace: {exc}") from None
    return ChunkHasher(namespace).keys(tokens), namespace.chunk_tokens


class AdminBackend(Protocol):
    """What the admin API needs of a node (:class:`kvpool.server.node.Node`)."""

    @property
    def node_id(self) -> str: ...

    @property
    def events(self) -> EventBus: ...

    async def snapshot(self) -> dict[str, Any]: ...

    def cluster_info(self) -> dict[str, Any]: ...

    async def lookup(self, keys: Sequence[bytes]) -> list[int]: ...

    async def change(self, action: str, node_id: str, fields: dict[str, Any]) -> ClusterMap: ...

    async def metrics_text(self) -> bytes | None: ...


def make_admin_app(node: AdminBackend) -> web.Application:
    node_id, events, lookup, change = node.node_id, node.events, node.lookup, node.change

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "node_id": node_id})

    async def stats(_request: web.Request) -> web.Response:
        return web.json_response(await node.snapshot())

    async def cluster_map(_request: web.Request) -> web.Response:
        return web.json_response(node.cluster_info())

    async def lookup_route(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, "bad_request", f"the body is not JSON: {exc}")
        try:
            keys, chunk_tokens = _parse_lookup(body)
        except (ConfigError, InvalidKeyError) as exc:
            return _error(400, "bad_request", str(exc))
        try:
            tiers = await lookup(keys) if keys else []
        except KvpoolError as exc:
            return _error(503, "unavailable", f"{type(exc).__name__}: {exc}")
        reply: dict[str, Any] = {"num_chunks": len(tiers),
                                 "tiers": [_TIER_NAMES.get(t, "?") for t in tiers],
                                 "keys": [k.hex() for k in keys[: len(tiers)]]}
        if chunk_tokens is not None:
            reply["num_tokens"] = len(tiers) * chunk_tokens
            reply["chunk_tokens"] = chunk_tokens
        return web.json_response(reply)

    async def change_route(request: web.Request) -> web.Response:
        action = request.match_info["action"]
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, "bad_request", f"the body is not JSON: {exc}")
        if not isinstance(body, dict) or not isinstance(body.get("id"), str) or not body["id"]:
            return _error(400, "bad_request", 'the body must be {"id": "<node id>", ...}')
        fields = {k: v for k, v in body.items() if k in ("data", "admin", "weight")}
        extra = set(body) - {"id", *fields}
        if extra:
            return _error(400, "bad_request", f"unknown field(s) {sorted(extra)}")
        try:
            new = await change(action, body["id"], fields)
        except StaticMapError as exc:
            return _error(409, "static_map", str(exc))
        except ConfigError as exc:
            return _error(400, "bad_request", str(exc))
        except KvpoolError as exc:
            return _error(503, "unavailable", f"{type(exc).__name__}: {exc}")
        return web.json_response(new.to_dict())

    async def events_route(request: web.Request) -> web.StreamResponse:
        wanted = request.query.get("types", ",".join(EVENT_TYPES))
        types = frozenset(t for t in wanted.split(",") if t)
        unknown = types - set(EVENT_TYPES)
        if unknown or not types:
            return _error(400, "bad_request", f"unknown event type(s) {sorted(unknown)}; "
                          f"known: {list(EVENT_TYPES)}")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        sub = events.subscribe(types)
        try:
            await response.write(b": kvpool events from " + node_id.encode() + b"\n\n")
            while not sub.closed:
                try:
                    event = await asyncio.wait_for(sub.queue.get(), SSE_HEARTBEAT_S)
                except TimeoutError:
                    await response.write(b": heartbeat\n\n")
                    continue
                chunk = [event, *(sub.queue.get_nowait() for _ in range(sub.queue.qsize()))]
                chunk = [e for e in chunk if e["type"] != "closed"]
                lines = [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in chunk]
                if sub.lost:
                    lines.append(f"event: lost\ndata: {json.dumps({'lost': sub.lost})}\n\n")
                    sub.lost = 0
                await response.write("".join(lines).encode())
        except ConnectionResetError:
            pass  # the listener went away
        finally:
            events.unsubscribe(sub)
        return response

    async def metrics(_request: web.Request) -> web.Response:
        text = await node.metrics_text()
        if text is None:
            return _error(404, "not_found", "metrics are off on this node (--no-metrics)")
        return web.Response(body=text, headers={"Content-Type": METRICS_CONTENT_TYPE})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/v1/cluster", cluster_map)
    app.router.add_post("/v1/lookup", lookup_route)
    app.router.add_get("/v1/events", events_route)
    app.router.add_post(r"/v1/cluster/{action:join|drain|remove}", change_route)
    return app
