"""Process hardening for nodes that serve tenants."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

__all__ = ["die_with_parent", "forbid_dumps"]

log = logging.getLogger("kvpool.server")

_PR_SET_DUMPABLE = 4
_PR_SET_PDEATHSIG = 1


def _prctl(option: int, arg: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False  # pragma: no cover
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, arg, 0, 0, 0) == 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl in this libc
        return False


def die_with_parent(parent_pid: int) -> None:
    """Get SIGKILL when the parent (the node) dies, so a node restarted at once after a
    kill -9 does not find the old worker still holding the RocksDB lock. A worker killed
    so is a crash like its node's: RocksDB's log keeps what it had written."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the node died before we asked
        os._exit(1)


def forbid_dumps() -> bool:
    """Make this process non-dumpable (Linux): processes of the same user can no longer
    ptrace it or open its ``/proc/<pid>/fd``, ``mem`` and ``maps`` -- which would reach the
    DRAM arena and every tenant's chunks in it. Costs core dumps (and ptrace-based
    profilers need root). False where the call is not available."""
    if _prctl(_PR_SET_DUMPABLE, 0):
        return True
    log.warning("could not make this process non-dumpable: processes of its user can read "
                "its memory")
    return False
