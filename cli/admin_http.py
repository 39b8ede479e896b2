"""A small blocking client of a node's admin REST API, for the CLI.

Plain ``urllib`` so the commands work against any node, local or not, with no
event loop. The token (``--token``, or ``KVPOOL_ADMIN_TOKEN``) goes out as a
bearer token: mutating routes need an admin token, and reads need a read token
on nodes with a tokens file. ``https://`` admin URLs are verified against
``--cacert`` (or ``KVPOOL_TLS_CA``), else the system's CAs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import urllib.error
import urllib.request
from typing import Any

__all__ = ["AdminError", "add_admin_args", "admin_base", "admin_bases", "call_admin",
           "call_first", "call_with_args", "default_token"]

DEFAULT_ADMIN = "http://127.0.0.1:7701"


class AdminError(Exception):
    """A node's admin API could not be reached or answered with an error.

    ``status`` is the HTTP status (0 when the node could not be reached).
    """

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def default_token() -> str:
    return os.environ.get("KVPOOL_ADMIN_TOKEN", "")


def admin_base(admin: str, like: str = "") -> str:
    """``host:port`` or a URL, as a base URL without a trailing slash.

    A bare ``host:port`` takes the scheme of ``like`` (the URL the user gave: cluster maps
    list nodes' admin addresses without one, and a cluster's nodes all serve TLS or none).
    """
    admin = admin.rstrip("/")
    if admin.startswith(("kvpool://", "kvpools://")):
        raise AdminError(f"{admin} is a data address: the admin commands take a node's admin "
                         "URL, http://host:port (its admin port: by default the data port + "
                         "1, 7701)")
    if "://" in admin:
        return admin
    scheme = like.split("://", 1)[0] if "://" in like else "http"
    return f"{scheme}://{admin}"


def admin_bases(admin: str) -> list[str]:
    """A comma-separated list of admin URLs or ``host:port`` -> base URLs, in order."""
    first = admin.split(",", 1)[0]
    bases = [admin_base(a.strip(), first) for a in admin.split(",") if a.strip()]
    if not bases:
        raise AdminError(f"no admin URL in {admin!r}")
    return bases


def call_admin(url: str, body: dict[str, Any] | None = None, *, method: str | None = None,
               timeout: float = 5.0, token: str = "", cafile: str = "") -> dict[str, Any]:
    """One JSON call (POST when there is a body); AdminError on any failure.

    ``cafile``: the PEM CA bundle an ``https://`` node's certificate must chain to ('' =
    the system's).
    """
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, headers=headers,
                                     method=method or ("POST" if data else "GET"))
    try:
        context = ssl.create_default_context(cafile=cafile) if cafile else None
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            reply: dict[str, Any] = json.load(response)
            return reply
    except urllib.error.HTTPError as exc:
        try:
            error = json.load(exc)["error"]
            message = f"{error['type']}: {error['message']}"
        except (ValueError, KeyError, TypeError):
            message = str(exc)
        raise AdminError(f"{url}: HTTP {exc.code} {message}", exc.code) from None
    except http.client.HTTPException as exc:  # something answered, not in HTTP
        raise AdminError(f"{url} did not answer in HTTP ({type(exc).__name__}): is that a "
                         "data port? The admin API is on the node's admin port (by default "
                         "the data port + 1, 7701)") from None
    except (OSError, ValueError) as exc:
        raise AdminError(f"cannot reach {url}: {exc}") from None


def add_admin_args(parser: argparse.ArgumentParser, *, token: bool = False) -> None:
    """``--admin`` (any node's admin URL), ``--token`` and ``--cacert``; ``token``: the
    command mutates, so its token must be an admin one."""
    parser.add_argument("--admin", default=os.environ.get("KVPOOL_ADMIN") or DEFAULT_ADMIN,
                        help="admin URL of any node, or several, comma-separated, tried in "
                        f"order (default: $KVPOOL_ADMIN, else {DEFAULT_ADMIN})")
    parser.add_argument("--token", default=default_token(),
                        help=("the nodes' admin token" if token else
                              "a token that may read, for nodes with a tokens file")
                        + " (default: $KVPOOL_ADMIN_TOKEN)")
    parser.add_argument("--cacert", default=os.environ.get("KVPOOL_TLS_CA", ""),
                        help="PEM CA bundle that signed the nodes' TLS certificates, for "
                        "https:// admin URLs (default: $KVPOOL_TLS_CA, else the system's)")


def call_with_args(args: argparse.Namespace, url: str, body: dict[str, Any] | None = None, *,
                   method: str | None = None) -> dict[str, Any]:
    """:func:`call_admin` with the command's ``--timeout``, ``--token`` and ``--cacert``."""
    return call_admin(url, body, method=method, timeout=args.timeout, token=args.token,
                      cafile=args.cacert)


def call_first(args: argparse.Namespace, path: str, body: dict[str, Any] | None = None, *,
               bases: list[str] | None = None) -> tuple[str, dict[str, Any]]:
    """Ask the ``--admin`` nodes (or ``bases``) in turn; the first that answers, and its
    reply. A node that answers with an HTTP error is the answer (it was reachable); when
    none can be reached, the AdminError says so for the first and counts the rest."""
    bases = bases if bases is not None else admin_bases(args.admin)
    unreachable: list[AdminError] = []
    for base in bases:
        try:
            return base, call_with_args(args, base + path, body)
        except AdminError as exc:
            if exc.status:
                raise
            unreachable.append(exc)
    more = f" (nor {len(unreachable) - 1} other nodes)" if len(unreachable) > 1 else ""
    raise AdminError(f"{unreachable[0]}{more}")
