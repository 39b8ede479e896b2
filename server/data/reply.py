"""What an op of the op table gives back: the reply frame's buffers and what they pin."""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from kvpool.tiers.dram import Entry

__all__ = ["Buffers", "Pending", "Reply"]

Buffers = list[bytes | bytearray | memoryview]


@dataclass(slots=True)
class Reply:
    """A reply frame as buffers (values are arena memoryviews, never copied), the DRAM
    entries that must stay acquired until they have been written out, and the value bytes
    it carries."""

    buffers: Buffers
    held: list[Entry] = field(default_factory=list)
    num_bytes: int = 0


#: an op that must wait (a promotion, a write-through): the connection awaits it and
#: writes the reply when it is ready (replies carry request ids, so order is free)
Pending = Coroutine[Any, Any, Reply]
