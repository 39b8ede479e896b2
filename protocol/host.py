"""Which host a peer runs on: what a HELLO's ``host`` field carries.

A client asks for the shared-memory fast path by sending its host identity;
the node grants it only when the identity is its own (same machine, same boot:
the arena is a memory file only that kernel can map). Both ends compute it
here, so they always agree on what "same host" means. (The one read of the
machine in ``protocol/``: a small file, no sockets, no asyncio.)
"""

from __future__ import annotations

__all__ = ["host_id"]


def host_id() -> str:
    """This boot of this machine's kernel ('' where unknown: no fast path)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
