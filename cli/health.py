"""``kvpool health``: exit 0 when a node answers ``/healthz`` (the Docker image's HEALTHCHECK).

With no ``--url`` it probes the node that this process's configuration describes (the
``KVPOOL_*`` variables and ``KVPOOL_CONFIG``, as ``kvpool serve`` would read them): its
admin port on its bind address, or on 127.0.0.1 when it binds a wildcard. A node serving
TLS is probed over https without checking its certificate (the probe never leaves the
host, and a certificate names the advertised host, not 127.0.0.1).

Exit codes: 0 healthy; 1 unreachable or unhealthy (one line on stderr says why); 2 bad
configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.request
from collections.abc import Mapping

from kvpool.server.config import load_config

__all__ = ["add_health_command", "local_health_url"]

WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def local_health_url(env: Mapping[str, str] | None = None) -> str:
    """The ``/healthz`` URL of the node configured by ``env`` (default: this process's)."""
    config = load_config(None, os.environ if env is None else env)
    host = "127.0.0.1" if config.server.host in WILDCARDS else config.server.host
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if config.security.tls_cert else "http"
    return f"{scheme}://{host}:{config.server.admin_port}/healthz"


def _health(args: argparse.Namespace) -> int:
    url = args.url or local_health_url()
    if "://" not in url:
        url = f"http://{url}"
    if not url.rstrip("/").endswith("/healthz"):
        url = url.rstrip("/") + "/healthz"
    context = None
    if url.startswith("https://"):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=args.timeout, context=context) as reply:
            body = json.load(reply)
    except (OSError, ValueError) as exc:
        print(f"kvpool health: {url}: {exc}", file=sys.stderr)
        return 1
    if not isinstance(body, dict) or body.get("status") != "ok":
        print(f"kvpool health: {url} answered {body!r}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"ok {body.get('node_id', '')}")
    return 0


def add_health_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    health = sub.add_parser(
        "health", help="exit 0 when a node answers /healthz (for container health checks)",
        description="Probe a node's /healthz. With no --url: the node this environment "
        "configures (KVPOOL_* variables, KVPOOL_CONFIG), on its admin port.")
    health.add_argument("--url", default="",
                        help="admin URL or host:port (default: the configured local node)")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds (default: 2)")
    health.add_argument("--quiet", "-q", action="store_true", help="print nothing when healthy")
    health.set_defaults(func=_health)
