"""The production provider's exporter (the bytes it sends) and the span helper's errors.

``otlp_provider``'s exporter encodes spans in place, not with the OTLP
exporter's own encoder: these tests hold its encoding to the exporter's
message for the same spans, and send a traced webhook's spans to a
stand-in collector to read what arrives. ``tracing.span`` makes its span
current itself, not through ``use_span``: an error escaping its block is
recorded, and the context is restored.
"""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
    encode_spans as exporter_encode_spans,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from webhook_receiver import tracing

from ..helpers.signing import hmac_hex
from ..processing.conftest import SOURCE, config_with

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SENDER_SPAN = "00f067aa0ba902b7"


def _remote(flags: str, state: str | None = None) -> trace.Span:
    carrier = {"traceparent": f"00-{TRACE_ID}-{SENDER_SPAN}-{flags}"}
    if state:
        carrier["tracestate"] = state
    context = tracing._PROPAGATOR.extract(carrier)
    return trace.get_current_span(context)


def test_the_encoding_is_the_exporters_message():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "webhook-receiver"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("webhook_receiver")
    other = provider.get_tracer("other", "1.2", schema_url="https://example.com/schema")
    remote = _remote("01", "vendor=value")
    server = tracer.start_span(
        "POST /webhooks/<source_name>",
        context=trace.set_span_in_context(remote),
        kind=trace.SpanKind.SERVER,
        attributes={"text": "x", "empty": "", "int": 3, "float": 1.5, "flag": True},
    )
    server.set_attribute("list", ["a", "b"])
    server.add_event("retry", {"attempt": 2})
    server.add_link(remote.get_span_context(), {"why": "sender"})
    server.set_status(trace.StatusCode.ERROR, "boom")
    other.start_span("child", context=trace.set_span_in_context(server)).end()
    server.end()
    tracer.start_span("root", kind=trace.SpanKind.CONSUMER).end()
    spans = exporter.get_finished_spans()
    ours = ExportTraceServiceRequest.FromString(tracing.encode_spans(spans))
    assert ours == exporter_encode_spans(spans)


def test_a_traced_webhook_reaches_the_collector(make_app, downstream):
    provider = tracing.otlp_provider(downstream.url + "/v1/traces")
    app = make_app(config_with(), OTEL_TRACER_PROVIDER=provider)
    body = json.dumps({"type": "order.paid", "id": 1}).encode()
    sent_headers = {
        "Content-Type": "application/json",
        "X-Signature": f"sha256={hmac_hex(body, 'shop-secret-0123456789')}",
        "Idempotency-Key": "k-1",
        "traceparent": f"00-{TRACE_ID}-{SENDER_SPAN}-01",
    }
    try:
        answer = app.test_client().post(f"/webhooks/{SOURCE}", data=body, headers=sent_headers)
        assert answer.status_code == 200
        assert provider.force_flush()
    finally:
        provider.shutdown()
    (call,) = downstream.calls_to("/v1/traces")
    headers = {name.lower(): value for name, value in call.headers.items()}
    assert headers["content-type"] == "application/x-protobuf"
    sent = ExportTraceServiceRequest.FromString(call.body)
    (resource_spans,) = sent.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "webhook-receiver"
    spans = {s.name: s for scope in resource_spans.scope_spans for s in scope.spans}
    server, inbox = spans["POST /webhooks/<source_name>"], spans["inbox receive"]
    assert server.trace_id.hex() == inbox.trace_id.hex() == TRACE_ID
    assert server.parent_span_id.hex() == SENDER_SPAN
    assert inbox.parent_span_id == server.span_id
    attributes = {a.key: a.value for a in inbox.attributes}
    assert attributes["dedup_key"].string_value == "k-1"
    assert attributes["source"].string_value == SOURCE
    status = {a.key: a.value.int_value for a in server.attributes}["http.response.status_code"]
    assert status == 200


def test_an_error_escaping_a_span_is_recorded_and_the_context_restored(make_app):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = make_app(config_with(), OTEL_TRACER_PROVIDER=provider)
    with app.app_context():
        before = trace.get_current_span()
        with pytest.raises(ValueError, match="no such order"):
            with tracing.span("inbox receive", source=SOURCE, dedup_key="k-1", left_out=None):
                inner = trace.get_current_span()
                raise ValueError("no such order")
        assert trace.get_current_span() is before
    (span,) = exporter.get_finished_spans()
    assert span.context == inner.get_span_context()
    assert dict(span.attributes or {}) == {"source": SOURCE, "dedup_key": "k-1"}
    assert span.status.status_code is trace.StatusCode.ERROR
    assert span.status.description == "ValueError: no such order"
    assert [event.name for event in span.events] == ["exception"]
