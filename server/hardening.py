"""Process hardening for nodes that serve tenants."""

from __future__ import annotations

import ctypes
import logging
import sys

__all__ = ["forbid_dumps"]

log = logging.getLogger("kvpool.server")

_PR_SET_DUMPABLE = 4


def forbid_dumps() -> bool:
    """Make this process non-dumpable (Linux): processes of the same user can no longer
    ptrace it or open its ``/proc/<pid>/fd``, ``mem`` and ``maps`` -- which would reach the
    DRAM arena and every tenant's chunks in it. Costs core dumps (and ptrace-based
    profilers need root). False where the call is not available."""
    if not sys.platform.startswith("linux"):
        return False  # pragma: no cover
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl in this libc
        log.warning("could not make the node non-dumpable: processes of its user can read "
                    "its memory")
        return False
