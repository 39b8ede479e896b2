"""Large admin lookups are parsed in a child process, so they never stall the data path.

A maximal ``POST /v1/lookup`` (4M tokens, ~28 MB of JSON) took the event loop
for 0.6 s here (2.2-23 s measured by hostile testing on busier machines):
``json.loads`` alone is one C call that holds the GIL for ~0.35 s, so a thread
cannot help. Bodies over :data:`INLINE_BYTES` are streamed, as they arrive,
into a fresh ``python -c`` child (pure
:func:`kvpool.placement.lookup.parse_lookup`; it imports only
``kvpool.placement``, ~0.1 s to start), at most :data:`MAX_CONCURRENT` at a
time. The node keeps no copy of a large body, and a lookup waiting for a place
holds nothing but its socket buffers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Protocol

from kvpool.placement.lookup import LookupRequest, parse_lookup
from kvpool.protocol.errors import ConfigError, InvalidKeyError, ServerError

__all__ = ["INLINE_BYTES", "MAX_BODY_BYTES", "MAX_CONCURRENT", "BodyStream", "LookupParser",
           "LookupTooLargeError"]

#: bodies up to this size are parsed on the event loop (well under 1 ms of work)
INLINE_BYTES = 64 << 10
#: large lookups parsed at once (each child holds its body and ~2x that while parsing)
MAX_CONCURRENT = 2
#: a child that has not answered by then is killed (the request gets a 503)
CHILD_TIMEOUT_S = 60.0
#: the largest lookup body (4M token ids with room for long numbers and white space)
MAX_BODY_BYTES = 64 << 20
_PIECE = 64 << 10

_CHILD = """\
import json, sys
from kvpool.placement.lookup import parse_lookup
from kvpool.protocol.errors import KvpoolError
try:
    r = parse_lookup(sys.stdin.buffer.read())
    head, keys = {"chunk_tokens": r.chunk_tokens, "scope": r.scope, "num_keys": len(r.keys)}, \
        b"".join(r.keys)
except KvpoolError as exc:
    head, keys = {"error": type(exc).__name__, "message": str(exc)}, b""
except Exception as exc:  # never a traceback to the caller: what the parser could not take
    head, keys = {"error": "ConfigError",
                  "message": f"the body is not a lookup ({type(exc).__name__})"}, b""
sys.stdout.buffer.write(json.dumps(head).encode() + b"\\n" + keys)
"""
_ERRORS: dict[str, type[Exception]] = {"ConfigError": ConfigError,
                                        "InvalidKeyError": InvalidKeyError}
log = logging.getLogger("kvpool.server")


class LookupTooLargeError(ConfigError):
    """A lookup body over :data:`MAX_BODY_BYTES` (the admin API answers 413)."""


class LookupParser:
    """``await parse(body_stream, content_length)`` -> :class:`LookupRequest`."""

    def __init__(self, max_concurrent: int = MAX_CONCURRENT) -> None:
        self._slots = asyncio.Semaphore(max_concurrent)

    async def parse(self, body: BodyStream, content_length: int | None) -> LookupRequest:
        """Parse the request body; ConfigError/InvalidKeyError if it is bad.

        A large body is streamed to the child as it arrives (64 KiB at a time): the node
        holds no copy of it, whatever its size.
        """
        if content_length is not None and content_length > MAX_BODY_BYTES:
            raise LookupTooLargeError(f"a lookup body is at most {MAX_BODY_BYTES} bytes")
        if content_length is not None and content_length <= INLINE_BYTES:
            return parse_lookup(await body.read())
        async with self._slots:
            return await _in_child(body)


class BodyStream(Protocol):
    """What the parser needs of an HTTP request body (aiohttp's ``StreamReader``)."""

    async def read(self, n: int = -1) -> bytes: ...


async def _in_child(body: BodyStream) -> LookupRequest:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdin is not None
    try:
        async with asyncio.timeout(CHILD_TIMEOUT_S):
            sent = 0
            while chunk := await body.read(_PIECE):
                sent += len(chunk)
                if sent > MAX_BODY_BYTES:
                    raise LookupTooLargeError(f"a lookup body is at most {MAX_BODY_BYTES} "
                                              "bytes")
                proc.stdin.write(chunk)
                await proc.stdin.drain()
            proc.stdin.close()  # communicate() without input leaves stdin open (3.11)
            out, err = await proc.communicate()
    except TimeoutError:
        raise ServerError(f"parsing the lookup took longer than {CHILD_TIMEOUT_S}s") from None
    except (ConnectionError, BrokenPipeError) as exc:  # the child died early
        raise ServerError(f"the lookup parser exited: {exc}") from None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    line, _, keys = out.partition(b"\n")
    try:
        head = json.loads(line)
    except ValueError:  # what it printed is for the node's log, not for the caller
        log.error("the lookup parser exited %s: %s", proc.returncode,
                  err.decode(errors="replace")[-2000:])
        raise ServerError(f"the lookup parser exited {proc.returncode}") from None
    if "error" in head:
        raise _ERRORS.get(head["error"], ConfigError)(head["message"])
    n = head["num_keys"]
    if len(keys) != 16 * n:
        raise ServerError(f"the lookup parser sent {len(keys)} bytes for {n} keys")
    return LookupRequest([keys[i : i + 16] for i in range(0, len(keys), 16)],
                         head["chunk_tokens"], head["scope"])
