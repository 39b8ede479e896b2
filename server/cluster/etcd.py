"""Cluster membership in etcd, through its v3 JSON gateway (aiohttp; no client library).

Why the gateway: the maintained Python etcd3 clients pin old grpcio/protobuf
versions or are unmaintained; the gateway is part of every etcd server
since 3.3, is a handful of JSON calls (range, put, txn, lease grant and
keep-alive, watch as a stream of JSON lines), and aiohttp is already a
dependency of the node.

Keys, under ``prefix`` (default ``/kvpool/default``)::

    <prefix>/config        {"replication": r, "fallbacks": f}     created once
    <prefix>/nodes/<id>    {"id", "data", "admin", "weight", "state"}   the map entries
    <prefix>/alive/<id>    the same entry, attached to the node's lease

``nodes/*`` is the map: it changes only through transactions (a node's
first registration with ``auto_join``, and the admin ``join``, ``drain``
and ``remove`` requests). ``alive/*`` says who is running: a node keeps its
lease alive every ``lease_ttl_s / 3``; when a node dies, its lease expires
and etcd deletes its ``alive`` key, and every map built from then on shows
that node as ``down`` (it owns nothing; its keys move to the next nodes of
the ring). The epoch of a map is the etcd revision it was read at. Nodes
watch the prefix and re-read the map on every change; clients follow
through the nodes (every reply carries the node's epoch).

With ``user`` and ``password`` the node authenticates (``/v3/auth/authenticate``)
and sends etcd's token with every call; a token etcd no longer takes (simple
tokens expire after 5 minutes idle, or etcd restarted) is renewed once per
call. Without them, anyone who reaches etcd can rewrite the map: the node says
so at start when it has a tokens file.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from kvpool.placement.cluster_map import ClusterMap, NodeInfo, NodeState
from kvpool.protocol.errors import ConfigError, KvpoolConnectionError

__all__ = ["EtcdGateway", "EtcdSource", "b64", "prefix_end"]

log = logging.getLogger("kvpool.server")


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def prefix_end(prefix: str) -> str:
    """The range end covering every key that starts with ``prefix``."""
    raw = prefix.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


class _AuthTokenError(Exception):
    """etcd refused a call for its credentials (none given, a stale token, a wrong
    password)."""


#: what etcd's gateway says when a call's credentials are missing or no longer valid
_AUTH_ERRORS = ("invalid auth token", "user name is empty", "authentication failed",
                "permission denied", "invalid user id")


def _auth_refused(data: dict[str, Any]) -> bool:
    message = str(data.get("error") or data.get("message") or "").lower()
    return any(text in message for text in _AUTH_ERRORS)


class EtcdGateway:
    """etcd's v3 JSON gateway at ``endpoints`` (tried in turn; the next one after a failure),
    as ``user`` where one is given (its auth token renewed once a call when etcd no longer
    takes it); ``timeout_s`` a call, a watch's stream excepted."""

    def __init__(self, endpoints: list[str], *, user: str = "", password: str = "",
                 timeout_s: float = 5.0) -> None:
        self.endpoints = endpoints
        self.user = user
        self._password = password
        self.timeout_s = timeout_s
        #: etcd's auth token for ``user`` (sent as the Authorization header)
        self._token = ""
        self._session: aiohttp.ClientSession | None = None
        self._endpoint = 0

    def open(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    @property
    def is_open(self) -> bool:
        return self._session is not None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One JSON call, trying each endpoint once; KvpoolConnectionError if none answers.
        With a user, a call refused for its auth token authenticates again, once."""
        if self.user and not self._token:
            await self._authenticate()
        try:
            return await self._post_once(path, body)
        except _AuthTokenError as exc:
            if not self.user:
                raise ConfigError(f"etcd {path} refused: {exc} (etcd has auth on: give "
                                  "--etcd-user and KVPOOL_ETCD_PASSWORD_FILE)") from None
            await self._authenticate()
        try:
            return await self._post_once(path, body)
        except _AuthTokenError as exc:
            raise ConfigError(f"etcd {path} refused a fresh auth token: {exc}") from None

    async def _authenticate(self) -> None:
        self._token = ""
        try:
            data = await self._post_once("/v3/auth/authenticate",
                                         {"name": self.user, "password": self._password})
        except _AuthTokenError as exc:
            raise ConfigError(f"etcd refused user {self.user!r}: {exc}") from None
        self._token = str(data.get("token", ""))

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self._token} if self._token else {}

    async def _post_once(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self._session is not None
        errors = []
        for _ in range(len(self.endpoints)):
            url = self.endpoints[self._endpoint] + path
            try:
                async with self._session.post(url, json=body,
                                              headers=self._headers()) as response:
                    data: dict[str, Any] = await response.json(content_type=None)
                    if response.status != 200 or "error" in data:
                        if _auth_refused(data):
                            raise _AuthTokenError(str(data.get("error") or data))
                        raise ConfigError(f"etcd {path} failed: {data}")
                    return data
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors.append(f"{url}: {exc!r}")
                self._next_endpoint()
        raise KvpoolConnectionError(f"no etcd endpoint answered: {'; '.join(errors)}")

    def _next_endpoint(self) -> None:
        self._endpoint = (self._endpoint + 1) % len(self.endpoints)

    async def range_prefix(self, prefix: str) -> tuple[int, dict[str, str]]:
        """The revision, and every key under ``prefix`` with its value."""
        data = await self.post("/v3/kv/range", {"key": b64(prefix),
                                                "range_end": prefix_end(prefix)})
        kvs = {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in data.get("kvs", [])}
        return int(data["header"]["revision"]), kvs

    async def put(self, key: str, value: str, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        await self.post("/v3/kv/put", body)

    async def create(self, key: str, value: str) -> bool:
        """Put ``key`` only if it does not exist; True if this call created it."""
        data = await self.post("/v3/kv/txn", {
            "compare": [{"key": b64(key), "target": "CREATE", "result": "EQUAL",
                         "create_revision": "0"}],
            "success": [{"request_put": {"key": b64(key), "value": b64(value)}}]})
        return bool(data.get("succeeded"))

    async def replace(self, key: str, expect: str, value: str | None) -> bool:
        """Replace (or delete, for None) ``key`` only if it still holds ``expect``."""
        op = {"request_put": {"key": b64(key), "value": b64(value)}} if value is not None \
            else {"request_delete_range": {"key": b64(key)}}
        data = await self.post("/v3/kv/txn", {
            "compare": [{"key": b64(key), "target": "VALUE", "result": "EQUAL",
                         "value": b64(expect)}],
            "success": [op]})
        return bool(data.get("succeeded"))

    async def watch(self, prefix: str, revision: int) -> AsyncIterator[dict[str, Any]]:
        """The replies of a watch of ``prefix`` from ``revision`` on, one a change, until
        the stream ends (aiohttp's errors, KvpoolConnectionError or ConfigError: a stale
        token, renewed on the next call). The next call tries the next endpoint."""
        assert self._session is not None
        url = self.endpoints[self._endpoint] + "/v3/watch"
        self._next_endpoint()
        body = {"create_request": {"key": b64(prefix), "range_end": prefix_end(prefix),
                                   "start_revision": str(revision + 1)}}
        if self.user and not self._token:
            await self._authenticate()
        async with self._session.post(url, json=body, headers=self._headers(),
                                      timeout=aiohttp.ClientTimeout(total=None)) as resp:
            async for line in resp.content:
                reply: dict[str, Any] = json.loads(line)
                if _auth_refused(reply):  # a stale token: the next call renews it
                    self._token = ""
                    raise ConfigError(f"etcd watch refused: {reply}")
                yield reply


class EtcdSource:
    """The cluster map kept in etcd (see the module docstring)."""

    def __init__(self, endpoints: str, *, prefix: str = "/kvpool/default",
                 lease_ttl_s: float = 5.0, auto_join: bool = True, replication: int = 1,
                 timeout_s: float = 5.0, user: str = "", password: str = "") -> None:
        self.endpoints = [e.strip().rstrip("/") for e in endpoints.split(",") if e.strip()]
        if not self.endpoints:
            raise ConfigError("--etcd needs at least one endpoint URL (http://host:2379)")
        for e in self.endpoints:
            if not e.startswith(("http://", "https://")):
                raise ConfigError(f"etcd endpoint must be an http(s) URL, got {e!r}")
        self.prefix = prefix.rstrip("/")
        if not self.prefix.startswith("/"):
            raise ConfigError(f"etcd prefix must start with '/', got {prefix!r}")
        self.lease_ttl_s = lease_ttl_s
        self.auto_join = auto_join
        self.replication = replication
        self.user = user
        self.gateway = EtcdGateway(self.endpoints, user=user, password=password,
                                   timeout_s=timeout_s)
        self._lease = 0
        self._me: NodeInfo | None = None
        self._install: Callable[[ClusterMap], object] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.current: ClusterMap | None = None

    def describe(self) -> str:
        who = f" as {self.user}" if self.user else " without auth"
        return f"etcd {','.join(self.endpoints)} prefix {self.prefix}{who}"

    def _key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts])

    async def _read_all(self) -> tuple[int, dict[str, str]]:
        """The revision, and every key under the prefix with its value."""
        return await self.gateway.range_prefix(self.prefix + "/")

    # -- the map --------------------------------------------------------------------------

    def _build(self, revision: int, kvs: dict[str, str]) -> ClusterMap:
        config = json.loads(kvs.get(self._key("config"), "{}"))
        alive = {k.rsplit("/", 1)[1] for k in kvs if k.startswith(self._key("alive", ""))}
        nodes = []
        for key, value in sorted(kvs.items()):
            if not key.startswith(self._key("nodes", "")):
                continue
            entry = json.loads(value)
            if entry["id"] not in alive:
                entry["state"] = NodeState.DOWN.value
            nodes.append(NodeInfo(**entry))
        return ClusterMap(epoch=revision, nodes=tuple(nodes),
                          replication=int(config.get("replication", 1)),
                          fallbacks=int(config.get("fallbacks", 1)))

    async def read(self) -> ClusterMap:
        revision, kvs = await self._read_all()
        cmap = self._build(revision, kvs)
        self.current = cmap
        return cmap

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self, me: NodeInfo, install: Callable[[ClusterMap], object]) -> ClusterMap:
        self.gateway.open()
        self._me = me
        self._install = install
        try:
            await self.gateway.create(self._key("config"), json.dumps(
                {"replication": self.replication, "fallbacks": 1}))
            await self._register()
            if self.auto_join:
                revision, kvs = await self._read_all()
                entry = json.dumps(me.to_dict())
                self._check_entry(revision, kvs, me.id, entry)
                await self.gateway.create(self._key("nodes", me.id), entry)
            await self._relabel(me)
            cmap = await self.read()
        except BaseException:
            await self.stop()
            raise
        if me.id not in cmap.by_id:
            log.warning("node %s is registered in etcd but not in the map: POST "
                        "/v1/cluster/join to add it", me.id)
        self._tasks = [asyncio.create_task(self._keep_alive()),
                       asyncio.create_task(self._watch(cmap.epoch))]
        return cmap

    async def _relabel(self, me: NodeInfo) -> None:
        """A node restarted with other failure domains moves in the map too (its state
        and weight kept): placement follows the labels the node says it has."""
        key = self._key("nodes", me.id)
        for _ in range(10):
            revision, kvs = await self._read_all()
            current = kvs.get(key)
            if current is None:
                return
            entry = json.loads(current)
            labels = {k: v for k, v in me.to_dict().items() if k in ("host", "rack", "zone")}
            kept = {k: v for k, v in entry.items() if k not in ("host", "rack", "zone")}
            relabelled = NodeInfo(**{**kept, **labels}).to_dict()
            if relabelled == entry:
                return
            self._check_entry(revision, kvs, me.id, json.dumps(relabelled))
            if await self.gateway.replace(key, current, json.dumps(relabelled)):
                log.info("node %s: failure domains in the map are now %s", me.id, labels)
                return
        raise ConfigError(f"could not update node {me.id!r}'s labels in etcd: the entry kept "
                          "changing (10 tries)")

    def _check_entry(self, revision: int, kvs: dict[str, str], node_id: str,
                     entry: str) -> None:
        """Refuse to write an entry that would make the map unreadable for every node (a
        host named in two racks or zones): this node does not start, and says why."""
        try:
            self._build(max(revision, 1), {**kvs, self._key("nodes", node_id): entry})
        except ConfigError as exc:
            raise ConfigError(f"node {node_id!r} cannot join with these labels: {exc}") \
                from None

    async def _register(self) -> None:
        assert self._me is not None
        ttl = str(max(1, round(self.lease_ttl_s)))
        grant = await self.gateway.post("/v3/lease/grant", {"TTL": ttl})
        self._lease = int(grant["ID"])
        await self.gateway.put(self._key("alive", self._me.id), json.dumps(self._me.to_dict()),
                        self._lease)

    async def _keep_alive(self) -> None:
        interval = max(0.2, self.lease_ttl_s / 3)
        while True:
            await asyncio.sleep(interval)
            try:
                data = await self.gateway.post("/v3/lease/keepalive", {"ID": str(self._lease)})
                if int(data.get("result", {}).get("TTL", 0)) <= 0:
                    log.warning("etcd lease expired (node was paused?); registering again")
                    await self._register()
            except (KvpoolConnectionError, ConfigError) as exc:
                log.warning("etcd keep-alive failed: %s", exc)

    async def _watch(self, revision: int) -> None:
        """Follow changes under the prefix; re-read and install the map after each."""
        backoff = 0.2
        while True:
            try:
                async for reply in self.gateway.watch(self.prefix + "/", revision):
                    backoff = 0.2
                    if not reply.get("result", {}).get("events"):
                        continue
                    revision = self._install_valid(await self._read_valid(), revision)
            except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError,
                    KvpoolConnectionError, ConfigError) as exc:
                log.warning("etcd watch interrupted (%s); again in %.1fs", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(5.0, backoff * 2)
            revision = self._install_valid(await self._read_valid(), revision)

    def _install_valid(self, cmap: ClusterMap | None, revision: int) -> int:
        """Install ``cmap`` (None: none was read); the revision to watch from."""
        if cmap is None:
            return revision
        assert self._install is not None
        self._install(cmap)
        return cmap.epoch

    async def _read_valid(self) -> ClusterMap | None:
        try:
            return await self.read()
        except (ConfigError, KvpoolConnectionError) as exc:
            log.warning("etcd holds no usable cluster map right now: %s", exc)
            return None

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self.gateway.is_open and self._lease:
            # a clean stop leaves at once rather than when the lease runs out
            with contextlib.suppress(KvpoolConnectionError, ConfigError):
                await self.gateway.post("/v3/lease/revoke", {"ID": str(self._lease)})
        await self.gateway.close()

    def reload(self) -> ClusterMap | None:
        log.info("SIGHUP: the etcd map is followed by a watch; nothing to reload")
        return None

    # -- admin changes --------------------------------------------------------------------

    async def change(self, action: str, node_id: str,
                     fields: dict[str, Any] | None = None) -> ClusterMap:
        """``join`` (add, or bring a draining node back up), ``drain`` or ``remove`` a node.

        A join of a node that is not in the map takes its entry from ``fields``
        (``data``, ``admin``, ``weight``) or else from the node's own
        registration under ``alive/``.
        """
        key = self._key("nodes", node_id)
        for _ in range(10):  # optimistic concurrency: retry if another admin raced us
            _, kvs = await self._read_all()
            current = kvs.get(key)
            if action == "join":
                if current is None:
                    alive = kvs.get(self._key("alive", node_id))
                    base = json.loads(alive) if alive else {}
                    merged = {**base, **(fields or {}), "id": node_id}
                    if "data" not in merged:
                        raise ConfigError(f"node {node_id!r} is not registered in etcd: give "
                                          "its 'data' (and 'admin') address to join it")
                    entry = NodeInfo(**{**merged, "state": NodeState.UP.value}).to_dict()
                    done = await self.gateway.create(key, json.dumps(entry))
                else:
                    entry = {**json.loads(current), "state": NodeState.UP.value}
                    done = await self.gateway.replace(key, current, json.dumps(entry))
            elif action in ("drain", "remove"):
                if current is None:
                    raise ConfigError(f"node {node_id!r} is not in the cluster map")
                value = None if action == "remove" else json.dumps(
                    {**json.loads(current), "state": NodeState.DRAINING.value})
                done = await self.gateway.replace(key, current, value)
            else:
                raise ConfigError(f"unknown cluster change {action!r}")
            if done:
                cmap = await self.read()
                if self._install is not None:
                    self._install(cmap)
                return cmap
        raise ConfigError(f"cluster {action} of {node_id!r} kept racing other changes")
