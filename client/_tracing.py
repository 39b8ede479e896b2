"""Client spans and the trace context the client puts in its request frames.

Tracing follows the application: the client records spans with the tracer
provider it was given (``AsyncClient(tracer_provider=...)``) or, by default,
the global one the application installed with
``opentelemetry.trace.set_tracer_provider`` (noticed within a second). Without either, every check
below is one ``isinstance`` and a frame carries no trace context, so tracing
off costs nothing measurable (see ``bench/metrics_overhead.py``).

A request frame carries the context of the span current when it is sent
(the client operation's span, itself a child of the caller's span), so the
node's spans join the caller's trace.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Coroutine, Sized
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from opentelemetry import trace

from kvpool.protocol.frames import KEY_SIZE, pack_trace_context

__all__ = ["explicit_tracer", "traced", "wire_context"]

P = ParamSpec("P")
T = TypeVar("T")

_INVALID = trace.INVALID_SPAN
_PROXY = trace.ProxyTracerProvider
_NOOP = trace.NoOpTracerProvider


class _HasProvider(Protocol):
    tracer_provider: trace.TracerProvider | None
    tracer: trace.Tracer | None


class _GlobalTracer:
    """The global provider's tracer, looked up at most once a second while none is installed.

    (``trace.get_tracer_provider()`` reads the environment each call until an
    application installs a provider: ~2 us, more than the rest of a small GET.)
    """

    def __init__(self) -> None:
        self.tracer: trace.Tracer | None = None
        self.next_check = 0.0

    def check(self, now: float) -> trace.Tracer | None:
        """Look for an installed provider (at ``now``, monotonic); its tracer, if any."""
        self.next_check = now + 1.0
        provider = trace.get_tracer_provider()
        if not isinstance(provider, (_PROXY, _NOOP)):  # installed: it stays for good
            self.tracer = provider.get_tracer("kvpool.client")
        return self.tracer


_GLOBAL = _GlobalTracer()


def explicit_tracer(provider: trace.TracerProvider | None) -> trace.Tracer | None:
    """The tracer of a provider given to a client (None: none given, or a no-op one)."""
    if provider is None or isinstance(provider, (_PROXY, _NOOP)):
        return None
    return provider.get_tracer("kvpool.client")


def tracer_for(owner: _HasProvider) -> trace.Tracer | None:
    """The tracer for ``owner``'s spans, or None when no SDK provider is installed."""
    if owner.tracer_provider is not None:
        return owner.tracer
    tracer = _GLOBAL.tracer  # (checked here, not in a method: every call passes this way)
    if tracer is None and (now := time.monotonic()) >= _GLOBAL.next_check:
        return _GLOBAL.check(now)
    return tracer


def wire_context() -> bytes | None:
    """The current span's context for a request frame; None when there is no sampled span."""
    span = trace.get_current_span()
    if span is _INVALID:
        return None
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return pack_trace_context(ctx.trace_id, ctx.span_id, ctx.trace_flags)


def traced(name: str) -> Callable[
        [Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]],
        Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]]:
    """Wrap an ``AsyncClient`` batch method in a client span named ``kvpool.<name>``.

    The span records the number of keys (the first argument's length) and,
    for list results, how many items were found/true. When tracing is off the
    method's own coroutine is returned untouched.
    """
    span_name = f"kvpool.{name}"

    def decorate(fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]
                 ) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]:
        @functools.wraps(fn)
        def wrapper(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, T]:
            tracer = tracer_for(self)
            if tracer is None:
                return fn(self, *args, **kwargs)
            return _run(tracer, span_name, fn(self, *args, **kwargs),
                        _num_keys(args[0]) if args else None)
        return wrapper
    return decorate


def _num_keys(keys: object) -> int | None:
    if isinstance(keys, bytes):  # a blob of 16-byte keys
        return len(keys) // KEY_SIZE
    if isinstance(keys, str):  # one key in hex
        return 1
    return len(keys) if isinstance(keys, Sized) else None


async def _run(tracer: trace.Tracer, name: str, coro: Coroutine[Any, Any, T],
               num_keys: int | None) -> T:
    attributes = {"rpc.system": "kvpool"}
    with tracer.start_as_current_span(name, kind=trace.SpanKind.CLIENT,
                                      attributes=attributes) as span:
        if num_keys is not None:
            span.set_attribute("kvpool.keys", num_keys)
        result = await coro
        if isinstance(result, list):
            span.set_attribute("kvpool.found", sum(1 for r in result if r))
        return result
