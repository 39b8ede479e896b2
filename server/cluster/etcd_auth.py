"""Turn on etcd's auth for a kvpool cluster: a root user, and a user whose role may read
and write only the cluster's key prefix (what nodes log in as: ``--etcd-user``).

Used by the Compose stack's init service (``deploy/init-stack.py``) and by the tests;
by hand, ``etcdctl`` does the same (docs/security.md). Synchronous (``urllib``): it runs
once, before any node. Calls already made (a user that exists, auth already on) are
skipped, so running it again is harmless.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from kvpool.protocol.errors import ConfigError
from kvpool.server.cluster.etcd import b64, prefix_end

__all__ = ["auth_enabled", "enable_auth"]


def _call(endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(endpoint.rstrip("/") + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            data: dict[str, Any] = json.load(reply)
            return data
    except urllib.error.HTTPError as exc:
        data = json.load(exc)
        return data


def auth_enabled(endpoint: str) -> bool:
    """Whether etcd at ``endpoint`` refuses a call that carries no user."""
    reply = _call(endpoint, "/v3/kv/range", {"key": b64("/")})
    return "user name is empty" in str(reply.get("error", ""))


def enable_auth(endpoint: str, *, root_password: str, user: str, password: str,
                prefix: str) -> bool:
    """Create ``root`` and ``user`` (read-write on ``prefix`` and below, nothing else) and
    enable auth; False if auth was already on (nothing changed)."""
    if auth_enabled(endpoint):
        return False
    if not prefix.startswith("/") or not password or not root_password:
        raise ConfigError("enable_auth needs a /prefix and both passwords")
    start = prefix.rstrip("/") + "/"
    role = f"{user}-rw"
    steps: list[tuple[str, dict[str, Any]]] = [
        ("/v3/auth/role/add", {"name": "root"}),
        ("/v3/auth/user/add", {"name": "root", "password": root_password}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/role/add", {"name": role}),
        ("/v3/auth/role/grant", {"name": role, "perm": {
            "permType": "READWRITE", "key": b64(start), "range_end": prefix_end(start)}}),
        ("/v3/auth/user/add", {"name": user, "password": password}),
        ("/v3/auth/user/grant", {"user": user, "role": role}),
        ("/v3/auth/enable", {}),
    ]
    for path, body in steps:
        reply = _call(endpoint, path, body)
        error = str(reply.get("error", ""))
        if error and "already exists" not in error:
            raise ConfigError(f"etcd {path} failed: {error}")
    return True
