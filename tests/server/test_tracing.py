"""Traces: the frame's trace context, client spans, and a real node exporting its spans by OTLP
to a real OTLP/HTTP receiver (protobuf, decoded with opentelemetry-proto) on 127.0.0.1."""

from __future__ import annotations

import gzip
import http.server
import os
import threading
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvpool.client import AsyncClient
from kvpool.protocol.errors import BadFrameError, UnknownOpcodeError
from kvpool.protocol.frames import (
    OP_FLAG_TRACE,
    TRACE_CONTEXT_SIZE,
    FrameHeader,
    Op,
    PutItemHeader,
    encode_keys_request,
    pack_trace_context,
    unpack_trace_context,
)
from kvpool.protocol.parsers import RequestParser
from tests.conftest import http_json, start_node

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0xB7AD6B7169203331


def _traced(frame: list[bytes | bytearray | memoryview]) -> bytes:
    """Turn an encoded request frame into its traced form."""
    header = FrameHeader.unpack(frame[0])
    ctx = pack_trace_context(TRACE_ID, SPAN_ID, 1)
    header.op |= OP_FLAG_TRACE
    header.body_len += len(ctx)
    return header.pack() + ctx + b"".join(bytes(b) for b in frame[1:])


def test_trace_context_round_trips() -> None:
    ctx = unpack_trace_context(pack_trace_context(TRACE_ID, SPAN_ID, 1))
    assert ctx == (TRACE_ID, SPAN_ID, 1)
    with pytest.raises(BadFrameError, match="version"):
        unpack_trace_context(b"\x01" + bytes(TRACE_CONTEXT_SIZE - 1))
    with pytest.raises(BadFrameError, match="all-zero"):
        unpack_trace_context(pack_trace_context(TRACE_ID, 1, 1)[:17] + bytes(9))


def test_parser_strips_the_trace_context_at_every_split() -> None:
    keys = [bytes([i]) * 16 for i in range(3)]
    get = _traced(encode_keys_request(Op.GET, 7, keys))
    value = b"v" * 100
    put_body = PutItemHeader(keys[0], len(value)).pack() + value
    put = _traced([FrameHeader(Op.PUT, 8, 1, len(put_body)).pack(), put_body])
    plain = b"".join(bytes(b) for b in encode_keys_request(Op.EXISTS, 9, keys))
    stream = get + put + plain
    for split in range(1, len(stream)):
        parser = RequestParser()
        requests = parser.feed(stream[:split]) + parser.feed(stream[split:])
        assert parser.error is None
        assert [r.header.op for r in requests] == [Op.GET, Op.PUT, Op.EXISTS]
        assert list(requests[0].keys) == keys
        assert requests[0].trace == (TRACE_ID, SPAN_ID, 1)
        assert requests[1].trace == (TRACE_ID, SPAN_ID, 1)
        assert requests[1].header.body_len == len(put_body)
        assert requests[1].items[0].reservation is not None
        assert bytes(requests[1].items[0].reservation.view) == value
        assert requests[2].trace is None


def test_parser_refuses_bad_trace_frames() -> None:
    short = FrameHeader(Op.GET | OP_FLAG_TRACE, 1, 0, 10).pack() + bytes(10)
    parser = RequestParser()
    assert parser.feed(short) == []
    assert isinstance(parser.error, BadFrameError)
    unknown = FrameHeader(0x7F | OP_FLAG_TRACE, 1, 0, 26).pack() + bytes(26)
    parser = RequestParser()
    parser.feed(unknown)
    assert isinstance(parser.error, UnknownOpcodeError)


# -- a real node exporting to a real OTLP/HTTP receiver -----------------------------------


class _Receiver(http.server.BaseHTTPRequestHandler):
    spans: list[ProtoSpan]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path == "/v1/traces":
            request = ExportTraceServiceRequest.FromString(body)
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.server.spans.extend(scope_spans.spans)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def otlp_receiver() -> Iterator[tuple[str, list[ProtoSpan]]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    spans: list[ProtoSpan] = []
    server.spans = spans  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", spans
    finally:
        server.shutdown()
        server.server_close()


def _hex(i: int, n: int) -> str:
    return i.to_bytes(n, "big").hex()


async def test_spans_join_the_callers_trace_across_the_wire(
        otlp_receiver: tuple[str, list[ProtoSpan]]) -> None:
    endpoint, node_spans = otlp_receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    node = start_node("--dram-capacity", "64MiB", env=env)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = provider.get_tracer("engine")
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    values = [os.urandom(10_000) for _ in keys]
    try:
        async with AsyncClient(node.url, tracer_provider=provider, shm=False) as client, \
                AsyncClient(node.url, shm=False) as untraced:
            with app.start_as_current_span("request") as root:
                await client.put_many(keys, values)
                assert await client.get_many(keys) == values
            # move the chunks to SSD only, so the next traced GET reads that tier
            base = node.admin_url
            assert http_json(f"{base}/v1/admin/flush?timeout=10", "POST")[1]["flushed"]
            assert http_json(f"{base}/v1/admin/evict", "POST", {"tier": "dram"})[0] == 200
            with app.start_as_current_span("second"):
                assert await client.get_many(keys[:2]) == values[:2]
            # an application without an SDK provider sends no context: no node spans
            assert await untraced.get_many(keys) == values
            assert await untraced.exists_many(keys) == [True] * 4
    finally:
        # a clean stop exports the spans still queued, and the node exits after the export
        assert node.stop() == 0

    client_spans = {s.name: s for s in exporter.get_finished_spans()}
    trace_id = root.get_span_context().trace_id
    put_span = client_spans["kvpool.put_many"]
    assert put_span.context.trace_id == trace_id
    assert put_span.parent is not None
    assert put_span.parent.span_id == root.get_span_context().span_id
    assert put_span.attributes is not None and put_span.attributes["kvpool.keys"] == 4
    traced_ids = {s.context.trace_id for s in exporter.get_finished_spans()}

    by_name: dict[str, list[ProtoSpan]] = {}
    for span in node_spans:
        by_name.setdefault(span.name, []).append(span)
    # every node span belongs to a trace the engine started; none came from `untraced`
    assert {int.from_bytes(s.trace_id, "big") for s in node_spans} <= traced_ids
    assert len(by_name["kvpool.node PUT"]) == 1
    assert len(by_name["kvpool.node GET"]) == 2
    assert "kvpool.node EXISTS" not in by_name
    node_put = by_name["kvpool.node PUT"][0]
    assert node_put.trace_id.hex() == _hex(trace_id, 16)
    assert node_put.parent_span_id.hex() == _hex(put_span.context.span_id, 8)
    assert node_put.kind == ProtoSpan.SPAN_KIND_SERVER
    first_get = [s for s in by_name["kvpool.node GET"] if s.trace_id == node_put.trace_id]
    attrs = {a.key: a.value for a in first_get[0].attributes}
    assert attrs["kvpool.dram_hits"].int_value == 4
    # the second GET found nothing in DRAM and read both chunks from SSD, under its node span
    second_get = [s for s in by_name["kvpool.node GET"] if s.trace_id != node_put.trace_id]
    assert len(second_get) == 1
    ssd_reads = by_name["kvpool.ssd read"]
    assert len(ssd_reads) == 2
    assert {s.parent_span_id for s in ssd_reads} == {second_get[0].span_id}
    attrs = {a.key: a.value for a in second_get[0].attributes}
    assert attrs["kvpool.dram_hits"].int_value == 0
    assert attrs["kvpool.bytes"].int_value >= 2 * 10_000


def test_client_without_a_provider_puts_no_context_on_the_wire() -> None:
    from kvpool.client._tracing import wire_context

    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert wire_context() is None
    provider = TracerProvider()
    with provider.get_tracer("t").start_as_current_span("s") as span:
        ctx = wire_context()
        assert ctx is not None
        assert unpack_trace_context(ctx).span_id == span.get_span_context().span_id
