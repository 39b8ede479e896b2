"""The admin HTTP API (aiohttp); every route is in the OpenAPI document at ``/openapi.json``
(:mod:`kvpool.server.admin.openapi`).

Health (``/healthz``, ``/readyz``), ``/metrics``, stats, the cluster map and its
changes, cluster-wide prefix lookup for callers that are not Python, KV events,
and per-chunk and node-wide administration. Errors are JSON with one shape:
``{"error": {"type": "bad_request", "message": "..."}}``.

Auth: with a tokens file (``--auth-tokens``), every route but the probes,
``/metrics`` and ``/openapi.json`` needs ``Authorization: Bearer <token>``:
a read token for reads and lookups, write for deleting and pinning chunks,
admin for events, cluster changes and ``/v1/admin/*``. Keys in chunk routes
and lookups are in the caller's tenant scope (``?scope=shared``, or
``"scope"`` in a lookup body, for the shared scope; ``raw`` for stored keys,
admins only). The older ``--admin-token`` is an admin over stored keys; with
it alone, reads stay open and mutating routes (POST, DELETE but
``POST /v1/lookup``) need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from aiohttp import web

from kvpool.placement.cluster_map import ClusterMap
from kvpool.placement.keys import key_from_hex
from kvpool.protocol.errors import (
    ConfigError,
    InvalidKeyError,
    KvpoolError,
    PermissionDeniedError,
    ServerError,
)
from kvpool.protocol.frames import Op, tier_names
from kvpool.protocol.json_limits import check_depth
from kvpool.server.admin.events import EVENT_TYPES, EventBus
from kvpool.server.admin.lookup_offload import LookupParser, LookupTooLargeError
from kvpool.server.admin.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvpool.server.admin.openapi import openapi_document
from kvpool.server.cluster.membership import StaticMapError
from kvpool.server.security.auth import ANONYMOUS, Principal, Role, TokenTable, stored_keys

__all__ = ["make_admin_app"]

#: seconds between SSE comment lines on an idle event stream (keeps proxies from timing out)
SSE_HEARTBEAT_S = 15.0
#: the kernel send buffer of an event stream (the default grows to megabytes)
EVENTS_SNDBUF = 64 << 10
#: events written at once to a stream (~50 KB): one that stops reading is left with
#: at most that much and the transport's 64 KiB in user space, whatever it missed
EVENTS_PER_WRITE = 256


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message}}, status=status)


#: the largest JSON body of a route other than lookups (a cluster change, an eviction:
#: a few hundred bytes); larger ones are refused (413) before they are read
MAX_JSON_BODY = 64 << 10


async def _read_json(request: web.Request) -> Any:
    """The request body as JSON: HTTPRequestEntityTooLarge (413) over
    :data:`MAX_JSON_BODY`, ConfigError if it is not JSON or nests too deep (checked
    before it is parsed)."""
    length = request.content_length
    if length is not None and length > MAX_JSON_BODY:
        raise _too_large(length)
    body = await request.content.read(MAX_JSON_BODY + 1)
    if len(body) > MAX_JSON_BODY:
        raise _too_large(len(body))
    check_depth(body)
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"the body is not JSON: {exc}") from None


def _reset(transport: asyncio.BaseTransport | None) -> None:
    """End a dropped event stream at once, with a reset: a plain close would wait to flush
    what a listener that stopped reading never takes, and the kernel would hold its
    unsent bytes (and the listener would never learn it was dropped)."""
    if transport is None:
        return
    _set_option(transport, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()  # type: ignore[attr-defined]  # (a Transport: it has abort)


def _set_option(transport: asyncio.BaseTransport | None, option: int,
                value: int | bytes) -> None:
    """A SOL_SOCKET option on the transport's socket, where it has one (best effort)."""
    raw = transport.get_extra_info("socket") if transport is not None else None
    if raw is not None:
        with contextlib.suppress(OSError):
            raw.setsockopt(socket.SOL_SOCKET, option, value)


def _too_large(size: int) -> web.HTTPRequestEntityTooLarge:
    return web.HTTPRequestEntityTooLarge(
        max_size=MAX_JSON_BODY, actual_size=size, content_type="application/json",
        text=json.dumps({"error": {"type": "payload_too_large", "message":
                                   f"the body is at most {MAX_JSON_BODY} bytes"}}))


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

    @property
    def admin_token(self) -> str: ...

    @property
    def auth(self) -> TokenTable: ...

    def tenant_usage(self) -> dict[str, dict[str, int]]: ...

    def ready(self) -> tuple[bool, str]: ...

    def chunk_info(self, key: bytes) -> dict[str, Any] | None: ...

    def delete_chunk(self, key: bytes) -> bool: ...

    def pin_chunk(self, key: bytes, pinned: bool) -> bool: ...

    def evict(self, tier: str | None, namespace: bytes | None) -> dict[str, int]: ...

    async def flush(self, timeout_s: float) -> dict[str, Any]: ...


#: routes anyone may call: probes, metrics (counts only) and the API description
_PUBLIC = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json"})


def _always(_table: TokenTable) -> bool:
    return True


def _same_principal(digest: bytes | None, principal: Principal) -> Callable[[TokenTable], bool]:
    """Whether, under a reloaded tokens table, a caller who came with the token of
    ``digest`` (None: none, in open mode) is still ``principal`` (as a data connection
    is rechecked: ``NodeConnection.recheck``)."""
    def still(table: TokenTable) -> bool:
        now = ANONYMOUS if table.open else \
            table.principal_of(digest) if digest is not None else None
        return now == principal
    return still


def _role_needed(request: web.Request) -> Role:
    """Node administration needs an admin token; chunk routes and lookups ask the data
    port's table (:func:`kvpool.server.security.auth.check`) for their op and scope instead."""
    path = request.path
    if path.startswith(("/v1/admin/", "/v1/events")) or (
            path.startswith("/v1/cluster/") and request.method == "POST"):
        return Role.ADMIN
    return Role.READ


def _scoped(request: web.Request, keys: list[bytes], op: Op,
            scope: str | None = None) -> list[bytes]:
    """The stored keys the caller means (its tenant's scope, or ``?scope=``), if it may
    do ``op`` on them (PermissionDeniedError where the data port would refuse it)."""
    principal: Principal = request.get("principal", ANONYMOUS)
    return stored_keys(principal, keys, scope if scope is not None
                       else request.query.get("scope", ""), op)


def make_admin_app(node: AdminBackend) -> web.Application:
    # Long by design: a route table. Each route is a small closure over ``node`` (aiohttp
    # hands a handler only the request), the two middlewares follow, then the table;
    # none of the handlers is over ~25 lines.
    node_id, events, lookup, change = node.node_id, node.events, node.lookup, node.change
    lookup_parser = LookupParser()

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "node_id": node_id})

    async def stats(request: web.Request) -> web.Response:
        snap = await node.snapshot()
        principal: Principal = request.get("principal", ANONYMOUS)
        if principal.role == Role.ADMIN:  # who uses how much: for operators, not tenants
            snap["auth"]["tenant_bytes"] = node.tenant_usage()
        return web.json_response(snap)

    async def cluster_map(_request: web.Request) -> web.Response:
        return web.json_response(node.cluster_info())

    async def lookup_route(request: web.Request) -> web.Response:
        try:
            parsed = await lookup_parser.parse(request.content, request.content_length)
            keys, chunk_tokens, scope = parsed.keys, parsed.chunk_tokens, parsed.scope
            stored = _scoped(request, keys, Op.LOOKUP, scope if isinstance(scope, str) else "?")
        except LookupTooLargeError as exc:
            return _error(413, "payload_too_large", str(exc))
        except (ConfigError, InvalidKeyError) as exc:
            return _error(400, "bad_request", str(exc))
        except PermissionDeniedError as exc:
            return _error(403, "forbidden", str(exc))
        except ServerError as exc:
            return _error(503, "unavailable", str(exc))
        try:
            tiers = await lookup(stored) if keys else []
        except KvpoolError as exc:
            return _error(503, "unavailable", f"{type(exc).__name__}: {exc}")
        reply: dict[str, Any] = {"num_chunks": len(tiers),
                                 "tiers": tier_names(tiers),
                                 "keys": [k.hex() for k in keys[: len(tiers)]]}
        if chunk_tokens is not None:
            reply["num_tokens"] = len(tiers) * chunk_tokens
            reply["chunk_tokens"] = chunk_tokens
        return web.json_response(reply)

    async def change_route(request: web.Request) -> web.Response:
        action = request.match_info["action"]
        if action not in ("join", "drain", "remove"):
            return _error(404, "not_found", f"no cluster action {action!r}: join, drain or "
                          "remove")
        try:
            body = await _read_json(request)
        except ConfigError as exc:
            return _error(400, "bad_request", str(exc))
        if not isinstance(body, dict) or not isinstance(body.get("id"), str) or not body["id"]:
            return _error(400, "bad_request", 'the body must be {"id": "<node id>", ...}')
        fields = {k: v for k, v in body.items()
                  if k in ("data", "admin", "weight", "host", "rack", "zone")}
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
        transport = request.transport
        # a listener that stops reading stops being written to soon
        _set_option(transport, socket.SO_SNDBUF, EVENTS_SNDBUF)
        sub = events.subscribe(types, keep=request["still_allowed"],
                               on_close=lambda: _reset(transport))
        try:
            await response.write(b": kvpool events from " + node_id.encode() + b"\n\n")
            while not sub.closed:  # dropped (behind, a revoked token): nothing more is sent
                try:
                    async with asyncio.timeout(SSE_HEARTBEAT_S):
                        got = await events.wait(sub, EVENTS_PER_WRITE)
                except TimeoutError:
                    await response.write(b": heartbeat\n\n")
                    continue
                if got:
                    await response.write(b"".join(e.line for e in got))
        except ConnectionResetError:
            pass  # the listener went away, or was dropped
        finally:
            events.unsubscribe(sub)
        return response

    async def metrics(_request: web.Request) -> web.Response:
        text = await node.metrics_text()
        if text is None:
            return _error(404, "not_found", "metrics are off on this node (--no-metrics)")
        return web.Response(body=text, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def readyz(_request: web.Request) -> web.Response:
        ready, reason = node.ready()
        return web.json_response({"ready": ready, "reason": reason, "node_id": node_id},
                                 status=200 if ready else 503)

    def _key(request: web.Request, op: Op) -> bytes:
        try:
            return _scoped(request, [key_from_hex(request.match_info["key"])], op)[0]
        except (InvalidKeyError, ConfigError) as exc:
            raise web.HTTPBadRequest(text=json.dumps(
                {"error": {"type": "bad_request", "message": str(exc)}}),
                content_type="application/json") from None
        except PermissionDeniedError as exc:
            raise web.HTTPForbidden(text=json.dumps(
                {"error": {"type": "forbidden", "message": str(exc)}}),
                content_type="application/json") from None

    def _missing(key: bytes) -> web.Response:
        return _error(404, "not_found", f"no tier of node {node_id} holds {key.hex()}")

    async def chunk_get(request: web.Request) -> web.Response:
        key = _key(request, Op.EXISTS)
        info = node.chunk_info(key)
        return web.json_response(info) if info is not None else _missing(key)

    async def chunk_delete(request: web.Request) -> web.Response:
        key = _key(request, Op.DELETE)
        if not node.delete_chunk(key):
            return _missing(key)
        return web.json_response({"key": key.hex(), "deleted": True})

    async def chunk_pin(request: web.Request) -> web.Response:
        action = request.match_info["action"]
        if action not in ("pin", "unpin"):
            return _error(404, "not_found", f"no action {action!r} on a chunk: pin or unpin")
        pinned = action == "pin"
        key = _key(request, Op.PIN if pinned else Op.UNPIN)
        if not node.pin_chunk(key, pinned):
            return _error(404, "not_found", f"{key.hex()} is not in node {node_id}'s DRAM tier "
                          "(only DRAM chunks can be pinned)")
        return web.json_response({"key": key.hex(), "pinned": pinned})

    async def _json_object(request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        body = await _read_json(request)
        if not isinstance(body, dict):
            raise ConfigError("the body must be a JSON object")
        return body

    async def evict(request: web.Request) -> web.Response:
        try:
            body = await _json_object(request)
            extra = set(body) - {"tier", "namespace"}
            if extra:
                raise ConfigError(f"unknown field(s) {sorted(extra)}")
            tier, ns = body.get("tier"), body.get("namespace")
            if tier not in (None, "dram", "ssd"):
                raise ConfigError("'tier' must be 'dram' or 'ssd'")
            if ns is not None and not isinstance(ns, str):
                raise ConfigError("'namespace' must be the namespace digest, 32 hex characters")
            if tier is None and ns is None:
                raise ConfigError("give 'tier' (dram or ssd) or 'namespace' (a digest)")
            if ns is not None and tier == "ssd":
                raise ConfigError("eviction by namespace covers the DRAM tier only")
            namespace = key_from_hex(ns) if ns is not None else None
        except (ConfigError, InvalidKeyError) as exc:
            return _error(400, "bad_request", str(exc))
        return web.json_response({"evicted": node.evict(tier, namespace)})

    async def flush(request: web.Request) -> web.Response:
        raw = request.query.get("timeout", "30")
        try:
            timeout = float(raw)
            if not 0 <= timeout <= 600:
                raise ValueError
        except ValueError:
            return _error(400, "bad_request", f"timeout must be seconds in [0, 600], got {raw!r}")
        return web.json_response(await node.flush(timeout))

    async def openapi(_request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    token = node.admin_token.encode()

    @web.middleware
    async def require_token(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in _PUBLIC:
            response: web.StreamResponse = await handler(request)
            return response
        # aiohttp decodes header bytes that are not UTF-8 as surrogates: they match no
        # token (401), and must not fail to encode (500)
        given = request.headers.get("Authorization", "")
        bearer = given[7:] if given.startswith("Bearer ") else ""
        table = node.auth
        needed = _role_needed(request)
        principal: Principal | None = None
        if token and hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                         b"Bearer " + token):
            principal = ANONYMOUS  # the --admin-token: an admin over stored keys
            request["still_allowed"] = _always  # (not reloaded: a flag, not the file)
        elif not table.open:
            principal = table.authenticate(bearer)
            if principal is None:
                return _error(401, "unauthorized", "this node requires a token: "
                              "Authorization: Bearer <token>")
            request["still_allowed"] = _same_principal(table.digest(bearer), principal)
        elif not token or (needed < Role.ADMIN and (
                request.method not in ("POST", "DELETE") or request.path == "/v1/lookup")):
            # open mode; with just an --admin-token reads stay open, but not what needs
            # an admin (the events stream)
            principal = ANONYMOUS
            request["still_allowed"] = _same_principal(None, principal)
        if principal is None:
            return _error(401, "unauthorized", "this route needs the admin token: "
                          "Authorization: Bearer <token>")
        if principal.role < needed:
            return _error(403, "forbidden", f"this route needs a {needed.name.lower()} token; "
                          f"this one is {principal}")
        request["principal"] = principal
        response = await handler(request)
        return response

    @web.middleware
    async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
        """aiohttp's own errors (no route, wrong method, body too large) in the JSON shape."""
        try:
            response: web.StreamResponse = await handler(request)
        except web.HTTPException as exc:
            if exc.content_type == "application/json" or exc.status < 400:
                raise
            kind = {404: "not_found", 405: "method_not_allowed",
                    413: "payload_too_large"}.get(exc.status, "bad_request")
            return _error(exc.status, kind, f"{exc.reason}: {request.method} {request.path}")
        return response

    app = web.Application(client_max_size=64 << 20, middlewares=[json_errors, require_token])
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/v1/chunks/{key}", chunk_get)
    app.router.add_delete("/v1/chunks/{key}", chunk_delete)
    app.router.add_post("/v1/chunks/{key}/{action}", chunk_pin)
    app.router.add_post("/v1/admin/evict", evict)
    app.router.add_post("/v1/admin/flush", flush)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/v1/cluster", cluster_map)
    app.router.add_post("/v1/lookup", lookup_route)
    app.router.add_get("/v1/events", events_route)
    app.router.add_post("/v1/cluster/{action}", change_route)
    return app
