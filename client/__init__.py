"""kvpool Python SDK: :class:`AsyncClient` (the core) and :class:`Client` (its sync facade).

Errors raised are the classes of :mod:`kvpool.protocol.errors`, re-exported here.
"""

from kvpool.client._async import AsyncClient, parse_url
from kvpool.client._options import ClientOptions
from kvpool.client._sync import Client
from kvpool.client.transport import MockTransport, TcpTransport, Transport
from kvpool.protocol.errors import (
    AuthenticationError,
    BadReplyError,
    BufferTooSmallError,
    CapacityError,
    CorruptChunkError,
    InvalidArgumentError,
    InvalidKeyError,
    KvpoolConnectionError,
    KvpoolError,
    KvpoolTimeoutError,
    NotDurableError,
    PermissionDeniedError,
    ValueTooLargeError,
)

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "BadReplyError",
    "BufferTooSmallError",
    "CapacityError",
    "Client",
    "ClientOptions",
    "CorruptChunkError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "KvpoolConnectionError",
    "KvpoolError",
    "KvpoolTimeoutError",
    "MockTransport",
    "NotDurableError",
    "PermissionDeniedError",
    "TcpTransport",
    "Transport",
    "ValueTooLargeError",
    "parse_url",
]
