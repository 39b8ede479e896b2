"""kvpool wire protocol: frames, opcodes, status codes, the chunk envelope, errors.

Pure: no sockets, no tiers. See docs/protocol.md for the byte layouts.
"""

from kvpool.protocol.envelope import (
    ENVELOPE_HEADER_SIZE,
    Codec,
    EnvelopeHeader,
    open_envelope,
    payload_checksum,
    seal,
)
from kvpool.protocol.errors import KvpoolError, Status
from kvpool.protocol.frames import KEY_SIZE, PROTOCOL_VERSION, FrameHeader, Op
from kvpool.protocol.parsers import Limits, Reply, ReplyParser, Request, RequestParser

__all__ = [
    "ENVELOPE_HEADER_SIZE",
    "KEY_SIZE",
    "PROTOCOL_VERSION",
    "Codec",
    "EnvelopeHeader",
    "FrameHeader",
    "KvpoolError",
    "Limits",
    "Op",
    "Reply",
    "ReplyParser",
    "Request",
    "RequestParser",
    "Status",
    "open_envelope",
    "payload_checksum",
    "seal",
]
