"""TLS contexts of a node: what it serves (data and admin ports) and what it trusts as a client.

Standard library ``ssl`` only. Serving: TLS 1.2 or newer, the node's
certificate chain and key; with a client CA, a client certificate signed by
it is required (mutual TLS). As a client of other nodes (hand-off, cluster
lookups): verify them against ``tls_ca`` (or the system store), and present
the node's own certificate when the cluster requires client certificates.
"""

from __future__ import annotations

import ssl

from kvpool.protocol.errors import ConfigError
from kvpool.server.config import SecurityConfig

__all__ = ["client_context", "server_context"]


def server_context(config: SecurityConfig) -> ssl.SSLContext | None:
    """The context the node's ports serve with (None: TLS off)."""
    if not config.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
        if config.tls_client_ca:
            ctx.load_verify_locations(config.tls_client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"TLS: cannot load {config.tls_cert} / {config.tls_key} / "
                          f"{config.tls_client_ca or '-'}: {exc}") from None
    return ctx


def client_context(config: SecurityConfig) -> ssl.SSLContext | None:
    """The context this node connects to its peers with (None: they serve plain TCP)."""
    if not config.tls_cert:
        return None
    try:
        ctx = ssl.create_default_context(cafile=config.tls_ca or None)
        if config.tls_client_ca:
            ctx.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"TLS: cannot load {config.tls_ca or 'the system CA store'}: "
                          f"{exc}") from None
    return ctx
