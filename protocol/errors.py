"""The one error tree of kvpool.

Every error a user of kvpool can see is a class here. Errors that cross the
wire travel as a :class:`Status` code and are rebuilt on the other side by
:func:`error_for_status`, so a client raises the same class the node meant.

::

    KvpoolError
    ├── ConfigError              bad configuration value (node or client)
    ├── InvalidKeyError          a key that is not 16 bytes / 32 hex chars
    ├── InvalidArgumentError     a call's argument out of range or of the wrong shape
    ├── ProtocolError            the byte stream is not a valid kvpool stream
    │   ├── BadFrameError        malformed or inconsistent frame
    │   │   └── WrongPortError   HTTP where a frame was expected (admin port vs data port)
    │   ├── FrameTooLargeError   frame or batch larger than the peer allows
    │   ├── UnknownOpcodeError   opcode this peer does not implement
    │   └── VersionMismatchError HELLO with a protocol version we do not speak
    ├── RequestError             the node understood the request and refused it
    │   ├── ValueTooLargeError   one value larger than the node's maximum
    │   ├── CapacityError        no room even after eviction (e.g. all pinned)
    │   ├── WrongOwnerError      the node does not own a key under its (newer) cluster map
    │   ├── AuthenticationError  no token, or one the node does not know
    │   ├── PermissionDeniedError the token's role may not do this
    │   └── NotDurableError      write-through on, and S3 did not take the chunk
    ├── CorruptChunkError        envelope invalid or checksum mismatch
    ├── BufferTooSmallError      get_into buffer smaller than the stored payload
    ├── KvpoolConnectionError    cannot reach the node / connection lost
    │   ├── KvpoolTimeoutError   a call ran past its deadline
    │   └── BadReplyError        a node's reply does not fit the request (also a
    │                            ProtocolError): the node counts as failed for the call
    └── ServerError              the node failed while handling a valid request
"""

from __future__ import annotations

import enum

__all__ = [
    "AuthenticationError",
    "PermissionDeniedError",
    "BadFrameError",
    "BadReplyError",
    "BufferTooSmallError",
    "CapacityError",
    "ConfigError",
    "CorruptChunkError",
    "FrameTooLargeError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "KvpoolConnectionError",
    "KvpoolError",
    "KvpoolTimeoutError",
    "LayoutError",
    "NotDurableError",
    "ProtocolError",
    "RequestError",
    "ServerError",
    "Status",
    "UnknownOpcodeError",
    "ValueTooLargeError",
    "VersionMismatchError",
    "WrongPortError",
    "WrongOwnerError",
    "error_for_status",
    "status_for_error",
]


class Status(enum.IntEnum):
    """Wire status codes, used per frame and per batch item."""

    OK = 0
    NOT_FOUND = 1
    BAD_FRAME = 2
    UNKNOWN_OP = 3
    VERSION_MISMATCH = 4
    VALUE_TOO_LARGE = 5
    NO_CAPACITY = 6
    INVALID_KEY = 7
    CORRUPT = 8
    FRAME_TOO_LARGE = 9
    INTERNAL = 10
    UNAVAILABLE = 11
    WRONG_OWNER = 12
    UNAUTHENTICATED = 13
    PERMISSION_DENIED = 14


class KvpoolError(Exception):
    """Base class of every kvpool error."""


class ConfigError(KvpoolError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class LayoutError(ConfigError):
    """An engine's KV-cache tensors do not match the declared :class:`KVLayout`."""


class InvalidKeyError(KvpoolError, ValueError):
    """A chunk key is not 16 bytes (or 32 lowercase hex characters)."""


class InvalidArgumentError(KvpoolError, ValueError):
    """An argument of an SDK call is out of range or unusable (a TTL that is not a finite
    positive number of seconds, a chunk index past u32, a buffer that is not contiguous);
    raised before anything is sent."""


class ProtocolError(KvpoolError):
    """The peer sent bytes that are not a valid kvpool stream."""


class BadFrameError(ProtocolError):
    """A frame is malformed: bad magic, inconsistent lengths, truncated body."""


class WrongPortError(BadFrameError):
    """HTTP where a kvpool frame was expected: a client of the data protocol reached an
    admin (HTTP) port, or an HTTP client reached a data port."""


class FrameTooLargeError(ProtocolError):
    """A frame or batch exceeds the limits the peer announced."""


class UnknownOpcodeError(ProtocolError):
    """The peer does not implement this opcode."""


class VersionMismatchError(ProtocolError):
    """Client and node speak different protocol versions."""


class RequestError(KvpoolError):
    """The node understood the request and refused it."""


class ValueTooLargeError(RequestError):
    """A value is larger than the node's ``max_value_bytes``."""


class CapacityError(RequestError):
    """The node had no room for a value even after evicting what it could."""

    def __init__(self, message: str, failed_keys: list[bytes] | None = None) -> None:
        super().__init__(message)
        self.failed_keys: list[bytes] = failed_keys or []


class NotDurableError(RequestError):
    """The node runs S3 write-through and could not get the chunk into S3.

    The chunk is cached (DRAM, SSD) but not durable; retry, or treat it as lost.
    """


class WrongOwnerError(RequestError):
    """The request was routed with an older cluster map than the node's.

    The reply's frame header carries the node's epoch; the client refreshes
    its map and sends the keys to their owners. Users rarely see this error:
    the SDK retries on it.
    """

    #: the node's cluster-map epoch, from the reply header
    epoch: int = 0


class AuthenticationError(RequestError):
    """The node requires a token and got none, or one it does not know."""


class PermissionDeniedError(RequestError):
    """The token's role does not allow this op (or this scope)."""


class CorruptChunkError(KvpoolError):
    """A stored chunk failed envelope validation or its checksum."""


class BufferTooSmallError(KvpoolError, ValueError):
    """A ``get_into`` buffer is smaller than the stored payload."""


class KvpoolConnectionError(KvpoolError, ConnectionError):
    """The node cannot be reached, or the connection broke mid-request."""


class KvpoolTimeoutError(KvpoolConnectionError, TimeoutError):
    """A call did not complete before its deadline."""


class BadReplyError(KvpoolConnectionError, ProtocolError):
    """A node's reply does not fit the request that was sent: another item count, more
    keys found than were asked, a body of the wrong size, limits or a cluster map out of
    any sane range. What a buggy, mismatched-version or compromised node sends.

    The message names the node. It is a connection error too, so the client treats the
    node as failed for the call (marked down, its connections closed, the keys asked of
    their replicas where the map has them), as it does a node that broke a connection.
    """

    def __init__(self, node: str, message: str) -> None:
        super().__init__(f"node {node} sent a bad reply: {message}")
        #: the node's id (or host:port)
        self.node = node


class ServerError(KvpoolError):
    """The node failed while handling a valid request (a bug: please report)."""


_ERROR_FOR_STATUS: dict[Status, type[KvpoolError]] = {
    Status.BAD_FRAME: BadFrameError,
    Status.UNKNOWN_OP: UnknownOpcodeError,
    Status.VERSION_MISMATCH: VersionMismatchError,
    Status.VALUE_TOO_LARGE: ValueTooLargeError,
    Status.NO_CAPACITY: CapacityError,
    Status.INVALID_KEY: InvalidKeyError,
    Status.CORRUPT: CorruptChunkError,
    Status.FRAME_TOO_LARGE: FrameTooLargeError,
    Status.INTERNAL: ServerError,
    Status.UNAVAILABLE: NotDurableError,
    Status.WRONG_OWNER: WrongOwnerError,
    Status.UNAUTHENTICATED: AuthenticationError,
    Status.PERMISSION_DENIED: PermissionDeniedError,
}

_STATUS_FOR_ERROR: dict[type[KvpoolError], Status] = {
    cls: status for status, cls in _ERROR_FOR_STATUS.items()
}


#: the most of a node's error message an error (and so a log line) carries
MESSAGE_LIMIT = 300


def _readable(message: str) -> str:
    """A node's error message as one short printable line: a node that sends a payload (or
    garbage) as its message would otherwise put kilobytes of binary into the engine's log."""
    text = "".join(c if c.isprintable() else "?" for c in message[:MESSAGE_LIMIT])
    if len(message) > MESSAGE_LIMIT:
        text += f"... ({len(message) - MESSAGE_LIMIT} more characters)"
    return text


def error_for_status(status: int, message: str) -> KvpoolError:
    """Build the error a wire ``status`` stands for (unknown codes become ServerError);
    ``message`` (the node's) is cut to :data:`MESSAGE_LIMIT` printable characters."""
    message = _readable(message)
    try:
        cls = _ERROR_FOR_STATUS[Status(status)]
    except (ValueError, KeyError):
        return ServerError(f"status {status}: {message}")
    return cls(message)


def status_for_error(exc: BaseException) -> Status:
    """The wire status to send for ``exc`` (anything unexpected is INTERNAL)."""
    for cls in type(exc).__mro__:
        status = _STATUS_FOR_ERROR.get(cls)
        if status is not None:
            return status
    return Status.INTERNAL
