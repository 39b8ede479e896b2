"""What a node says about itself, checked before the client uses it (STYLE habit 15).

A HELLO's limits size every frame the client builds and bound what it receives into
buffers of its own; a cluster map decides where every key goes and how large the ring
is. A node that is buggy, of another version or compromised could say anything there:
a ``max_batch`` of 0 or ``"many"``, a weight of 1e6 (a ring of billions of points). Each
check raises :class:`~kvpool.protocol.errors.BadReplyError` naming the node, which the
client treats as the node failing (the call fails over where the map allows).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from kvpool.placement.cluster_map import ClusterMap
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE
from kvpool.protocol.errors import BadFrameError, BadReplyError, ConfigError
from kvpool.protocol.frames import PROTOCOL_VERSION, decode_json, decode_statuses

__all__ = ["MAX_BATCH", "MAX_FRAME_BYTES", "MAX_VALUE_BYTES", "checked_hello", "checked_map",
           "reply_json", "reply_statuses"]

#: the ranges a HELLO's limits must lie in (a node's own config allows max_batch in
#: [1, 2**20]; values and frames: far above any KV chunk, far below a client's memory
#: being taken by one reply)
MAX_BATCH = 1 << 20
MAX_VALUE_BYTES = 1 << 36
MAX_FRAME_BYTES = 1 << 40
#: the HELLO fields a client reads, and what each must be
_INTS = {"max_batch": (1, MAX_BATCH), "max_value_bytes": (ENVELOPE_HEADER_SIZE + 1,
                                                          MAX_VALUE_BYTES),
         "max_frame_bytes": (ENVELOPE_HEADER_SIZE + 1, MAX_FRAME_BYTES),
         "epoch": (0, (1 << 63) - 1)}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def checked_hello(node: str, info: Mapping[str, Any]) -> dict[str, Any]:
    """A HELLO reply's JSON object if every field the client reads is of its type and in
    its range; BadReplyError naming ``node`` otherwise."""
    if info.get("protocol") != PROTOCOL_VERSION:
        raise BadReplyError(node, f"HELLO speaks protocol {info.get('protocol')!r}, "
                                  f"this client {PROTOCOL_VERSION}")
    for name, (low, high) in _INTS.items():
        value: Any = info.get(name)
        if not _is_int(value) or not low <= value <= high:
            raise BadReplyError(node, f"HELLO's {name} is {value!r}; an integer in "
                                      f"[{low}, {high}] was expected")
    if info["max_frame_bytes"] < info["max_value_bytes"]:
        raise BadReplyError(node, f"HELLO's max_frame_bytes {info['max_frame_bytes']} is "
                                  f"below its max_value_bytes {info['max_value_bytes']}")
    idle = info.get("idle_timeout_s", 0)
    if isinstance(idle, bool) or not isinstance(idle, int | float) or not math.isfinite(idle) \
            or idle < 0:
        raise BadReplyError(node, f"HELLO's idle_timeout_s is {idle!r}; seconds >= 0 were "
                                  "expected")
    if not isinstance(info.get("cluster", False), bool):
        raise BadReplyError(node, f"HELLO's cluster is {info.get('cluster')!r}, not a bool")
    node_id = info.get("node_id", "")
    if not isinstance(node_id, str) or len(node_id) > 256:
        raise BadReplyError(node, "HELLO's node_id is not a string of at most 256 characters")
    offer = info.get("shm")
    if offer is not None and not isinstance(offer, dict):
        raise BadReplyError(node, f"HELLO's shm offer is a {type(offer).__name__}, not an "
                                  "object")
    return dict(info)


def checked_map(node: str, data: Mapping[str, Any], fields: Collection[str]) -> ClusterMap:
    """The cluster map a CLUSTER reply gives (its ``fields``), or BadReplyError naming
    ``node``: the map's own checks (ids, addresses, weights in range, a ring of bounded
    size) as a map read from a file gets them."""
    try:
        return ClusterMap.from_dict({k: data[k] for k in fields if k in data})
    except (ConfigError, TypeError, ValueError) as exc:
        raise BadReplyError(node, f"its cluster map is not valid: {exc}") from None


def reply_json(node: str, body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A reply's JSON object (HELLO, STATS, CLUSTER), or BadReplyError naming ``node``."""
    try:
        return decode_json(body)
    except BadFrameError as exc:
        raise BadReplyError(node, str(exc)) from None


def reply_statuses(node: str, body: bytes | bytearray | memoryview, count: int) -> list[int]:
    """One status per item of a reply to ``count`` items, or BadReplyError naming ``node``."""
    try:
        return decode_statuses(body, count)
    except BadFrameError as exc:
        raise BadReplyError(node, str(exc)) from None
