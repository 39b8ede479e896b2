"""A small blocking client of a node's admin REST API, for the CLI.

Plain ``urllib`` so the commands work against any node, local or not, with no
event loop. The admin token (``--token``, or ``KVPOOL_ADMIN_TOKEN``) goes out
as a bearer token; reads never need it.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Any

__all__ = ["AdminError", "add_admin_args", "admin_base", "call_admin", "default_token"]


class AdminError(Exception):
    """A node's admin API could not be reached or answered with an error.

    ``status`` is the HTTP status (0 when the node could not be reached).
    """

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def default_token() -> str:
    return os.environ.get("KVPOOL_ADMIN_TOKEN", "")


def admin_base(admin: str) -> str:
    """``host:port`` or a URL, as a base URL without a trailing slash."""
    admin = admin.rstrip("/")
    return admin if "://" in admin else f"http://{admin}"


def call_admin(url: str, body: dict[str, Any] | None = None, *, method: str | None = None,
               timeout: float = 5.0, token: str = "") -> dict[str, Any]:
    """One JSON call (POST when there is a body); AdminError on any failure."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, headers=headers,
                                     method=method or ("POST" if data else "GET"))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            reply: dict[str, Any] = json.load(response)
            return reply
    except urllib.error.HTTPError as exc:
        try:
            error = json.load(exc)["error"]
            message = f"{error['type']}: {error['message']}"
        except (ValueError, KeyError, TypeError):
            message = str(exc)
        raise AdminError(f"{url}: HTTP {exc.code} {message}", exc.code) from None
    except (OSError, ValueError) as exc:
        raise AdminError(f"cannot reach {url}: {exc}") from None


def add_admin_args(parser: argparse.ArgumentParser, *, token: bool = False) -> None:
    """``--admin`` (any node's admin URL) and, for mutating commands, ``--token``."""
    parser.add_argument("--admin", default="http://127.0.0.1:7701",
                        help="admin URL of any node (default: http://127.0.0.1:7701)")
    if token:
        parser.add_argument("--token", default=default_token(),
                            help="the nodes' admin token (default: $KVPOOL_ADMIN_TOKEN)")
