"""A node's spans: one per traced request, children for the tier work it caused.

Off unless OTLP is configured the standard way (``OTEL_EXPORTER_OTLP_ENDPOINT``
or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, and ``OTEL_TRACES_EXPORTER`` not
``none``); then spans go out through a ``BatchSpanProcessor`` (its
``OTEL_BSP_*`` settings apply). Only requests whose frame carries a sampled
trace context are traced -- the caller decided to sample them -- so an
untraced request costs one attribute check, with tracing on or off.

Span names: ``kvpool.node <OP>`` (kind SERVER, a child of the client's span),
and under it ``kvpool.ssd read``, ``kvpool.s3 read`` and ``kvpool.s3 write``
for the cold-tier I/O done for that request. DRAM work takes microseconds, less
than a span costs, so it is recorded as attributes of the request's span
(``kvpool.dram_hits``, ``kvpool.bytes``). Write-behind to SSD and S3 happens
after the reply, outside any request, and is not traced.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags

from kvpool.protocol.frames import Op, TraceContext

__all__ = ["NodeTracing", "tier_span", "tracing_configured"]

_OP_SPAN_NAMES = {int(op): f"kvpool.node {op.name}" for op in Op}


def tracing_configured() -> bool:
    """True when the environment asks for OTLP trace export."""
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


class NodeTracing:
    """The node's TracerProvider with its OTLP exporter."""

    def __init__(self, node_id: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        resource = Resource.create({"service.name": "kvpool", "service.instance.id": node_id})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = self.provider.get_tracer("kvpool.server")

    def request_span(self, op: int, trace_ctx: TraceContext, peer: str, count: int) -> Span:
        """Start the SERVER span of one request, as a child of the caller's span."""
        parent = trace.set_span_in_context(NonRecordingSpan(SpanContext(
            trace_ctx.trace_id, trace_ctx.span_id, is_remote=True,
            trace_flags=TraceFlags(trace_ctx.trace_flags))))
        return self.tracer.start_span(
            _OP_SPAN_NAMES.get(op, f"kvpool.node {op}"), context=parent, kind=SpanKind.SERVER,
            attributes={"rpc.system": "kvpool", "kvpool.keys": count, "net.peer.name": peer})

    def shutdown(self) -> None:
        """Export what is queued, then stop."""
        self.provider.shutdown()


@contextlib.contextmanager
def tier_span(tracer: trace.Tracer | None, name: str, **attributes: int | str
              ) -> Iterator[Span | None]:
    """A child span of the current request's span, or nothing when it is not traced."""
    if tracer is None or not trace.get_current_span().is_recording():
        yield None
        return
    with tracer.start_as_current_span(name, attributes=attributes) as span:
        yield span
