"""JSON from a peer, bounded before it is parsed: how deep it nests.

``json.loads`` recurses once per level of nesting: a 2 KB body of 1,000 ``[`` is a
``RecursionError`` (or worse, in a parser without a guard), not a bad request. Every
JSON body kvpool accepts from a peer (an admin request, a lookup) is at most a few levels
deep, so :func:`check_depth` refuses anything deeper before a parser sees it. Pure: bytes
in, an error out; a few passes in numpy, linear in the body whatever it holds.

Brackets inside strings are counted too (no body kvpool takes has any there): skipping
strings takes a scan that knows escapes, and a regular expression for it is quadratic on
a body of escaped quotes. The count can only be larger than a parser's nesting, so a
body that passes cannot nest deeper.
"""

from __future__ import annotations

import numpy as np

from kvpool.protocol.errors import ConfigError

__all__ = ["MAX_JSON_DEPTH", "check_depth", "json_depth"]

#: the deepest JSON kvpool takes from a peer (its own bodies nest 3 deep at most)
MAX_JSON_DEPTH = 32
_OPEN_ARRAY, _OPEN_OBJECT, _CLOSE_ARRAY, _CLOSE_OBJECT = b"[{]}"


def json_depth(body: bytes | bytearray | memoryview) -> int:
    """The most ``[`` and ``{`` open at once in ``body`` (brackets in strings counted
    too): no smaller than how deep a parser would nest on it."""
    codes = np.frombuffer(body, dtype=np.uint8)
    opens = (codes == _OPEN_ARRAY) | (codes == _OPEN_OBJECT)
    closes = (codes == _CLOSE_ARRAY) | (codes == _CLOSE_OBJECT)
    where = np.flatnonzero(opens | closes)
    if not len(where):
        return 0
    steps = np.where(opens[where], 1, -1).astype(np.int64)
    return int(np.cumsum(steps).max(initial=0))


def check_depth(body: bytes | bytearray | memoryview, max_depth: int = MAX_JSON_DEPTH) -> None:
    """ConfigError if ``body`` nests deeper than ``max_depth``."""
    depth = json_depth(body)
    if depth > max_depth:
        raise ConfigError(f"the JSON body nests {depth} levels deep; at most {max_depth}")
