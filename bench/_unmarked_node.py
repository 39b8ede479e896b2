"""``python -m bench._unmarked_node serve ...``: a kvpool node that never sets a receive
low-water mark (protocol/wake.py), for the before/after of ``bench.peers --ab``."""

from __future__ import annotations

import runpy
import sys

from kvpool.protocol import wake

if __name__ == "__main__":
    wake.WAKE_MIN = 1 << 62  # no value is ever that large: the mark stays at 1
    sys.argv[0] = "kvpool.server"
    runpy.run_module("kvpool.server", run_name="__main__", alter_sys=True)
