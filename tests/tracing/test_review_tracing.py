"""The OTLP bytes for values protobuf cannot hold, and W3C Trace Context at the edges.

``encode_spans`` fills the export request in place: an attribute that
protobuf refuses (a lone surrogate, an integer past 64 bits) must cost that
attribute only, as the OTLP exporter's own encoder does, never the batch of
up to 256 spans it rides in. ``valid_traceparent`` decides which incoming
``traceparent`` is kept: W3C's rules, the same as the SDK propagator's,
so that an event's stored trace does not depend on whether tracing is on.
"""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
    encode_spans as exporter_encode_spans,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select

from webhook_receiver import tracing
from webhook_receiver.extensions import db
from webhook_receiver.models import Event

from ..helpers.signing import hmac_hex
from ..processing.conftest import SOURCE, config_with

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SENDER_SPAN = "00f067aa0ba902b7"


def _finished(*attribute_sets: dict) -> tuple:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("webhook_receiver")
    for number, attributes in enumerate(attribute_sets):
        tracer.start_span(f"span {number}", attributes=attributes).end()
    return exporter.get_finished_spans()


def _decoded(spans) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(tracing.encode_spans(spans))


@pytest.mark.parametrize(
    "bad",
    [
        "a lone \ud800 surrogate",
        ["fine", "\udcff"],
        2**64,
        -(2**63) - 1,
        [1, 2**70],
    ],
)
def test_an_attribute_protobuf_refuses_costs_that_attribute_not_the_batch(bad):
    spans = _finished({"ok": "kept"}, {"bad": bad, "after": 7}, {"ok": "kept too"})
    ours = _decoded(spans)
    # What the OTLP exporter's own encoder sends: the attribute left out.
    assert ours == exporter_encode_spans(spans)
    (scope,) = ours.resource_spans[0].scope_spans
    assert [span.name for span in scope.spans] == ["span 0", "span 1", "span 2"]
    assert [a.key for a in scope.spans[1].attributes] == ["after"]


def test_non_ascii_and_edge_values_encode_as_the_exporter_does():
    spans = _finished(
        {
            "text": "é日本🙂\u2028",
            "max": 2**63 - 1,
            "min": -(2**63),
            "bytes": b"\xff\x00",
            "nan": float("nan"),
            "inf": float("-inf"),
            "huge": "x" * 1_000_000,
            "empty list": [],
        }
    )
    ours = _decoded(spans)
    reference = exporter_encode_spans(spans)
    # NaN is not equal to itself: compare the bytes, which protobuf writes alike.
    assert ours.SerializeToString(deterministic=True) == reference.SerializeToString(
        deterministic=True
    )


def test_a_lone_surrogate_in_a_status_or_event_name_does_not_lose_the_batch():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("webhook_receiver")
    tracer.start_span("before").end()
    failed = tracer.start_span("failed")
    # What tracing.span records of an exception whose text holds client data.
    failed.record_exception(ValueError("no order \ud800"))
    failed.add_event("retry \udc80")
    failed.set_status(trace.Status(trace.StatusCode.ERROR, "ValueError: no order \ud800"))
    failed.end()
    tracer.start_span("after").end()
    ours = _decoded(exporter.get_finished_spans())
    (scope,) = ours.resource_spans[0].scope_spans
    assert [span.name for span in scope.spans] == ["before", "failed", "after"]
    sent = scope.spans[1]
    assert sent.status.code == trace.StatusCode.ERROR.value
    assert sent.status.message == "ValueError: no order \ufffd"
    assert [event.name for event in sent.events] == ["exception", "retry \ufffd"]
    # An attribute is left out, as the exporter's encoder leaves it; the rest stays.
    keys = [a.key for a in sent.events[0].attributes]
    assert "exception.type" in keys and "exception.message" not in keys


@pytest.mark.parametrize(
    "value",
    [
        # W3C: trace-id and parent-id are lower-case hex (HEXDIGLC); the SDK's
        # propagator ignores an upper-case one, so must the stored meta.
        f"00-{TRACE_ID.upper()}-{SENDER_SPAN}-01",
        f"00-{TRACE_ID}-{SENDER_SPAN.upper()}-01",
        f"0A-{TRACE_ID}-{SENDER_SPAN}-01",
        # Version 00 has exactly four fields.
        f"00-{TRACE_ID}-{SENDER_SPAN}-01-extra",
        f"00-{TRACE_ID}-{SENDER_SPAN}-01\u00a0",
    ],
)
def test_a_traceparent_w3c_calls_invalid_is_left_out(value):
    assert tracing.valid_traceparent(value) is None
    # As the SDK's propagator sees it: no remote parent.
    context = tracing._PROPAGATOR.extract({"traceparent": value})
    assert not trace.get_current_span(context).get_span_context().is_valid


@pytest.mark.parametrize(
    "value",
    [
        f"01-{TRACE_ID}-{SENDER_SPAN}-01-a-future-field",
        f"cc-{TRACE_ID}-{SENDER_SPAN}-01",
        f" \t00-{TRACE_ID}-{SENDER_SPAN}-01 ",
    ],
)
def test_a_traceparent_of_a_later_version_is_kept_as_version_00(value):
    # W3C: a higher version is parsed for its first four fields, and sent on
    # as the version this receiver speaks (the SDK's propagator takes it too).
    assert tracing.valid_traceparent(value) == f"00-{TRACE_ID}-{SENDER_SPAN}-01"
    context = tracing._PROPAGATOR.extract({"traceparent": value})
    assert trace.get_current_span(context).get_span_context().is_valid


def test_an_upper_case_traceparent_is_not_stored_nor_the_correlation_id(make_app):
    app = make_app(config_with())
    body = json.dumps({"type": "order.paid", "id": 9}).encode()
    headers = {
        "Content-Type": "application/json",
        "X-Signature": f"sha256={hmac_hex(body, 'shop-secret-0123456789')}",
        "Idempotency-Key": "k-9",
        "traceparent": f"00-{TRACE_ID.upper()}-{SENDER_SPAN}-01",
    }
    answer = app.test_client().post(f"/webhooks/{SOURCE}", data=body, headers=headers)
    assert answer.status_code == 200
    with app.app_context():
        event = db.session.scalars(select(Event)).one()
        assert "traceparent" not in event.meta
    assert answer.headers["X-Request-Id"] != TRACE_ID


@pytest.mark.parametrize("flags", ["00", "01"])
def test_untraced_a_forward_keeps_the_senders_sampled_flag(flags):
    # Not tracing, the receiver makes no sampling decision of its own: W3C
    # has it pass the sender's on, not mark every forward "sampled".
    headers: dict[str, str] = {}
    tracing.outgoing(headers, f"00-{TRACE_ID}-{SENDER_SPAN}-{flags}", "req-1")
    version, trace_id, parent, sent_flags = headers["traceparent"].split("-")
    assert (version, trace_id, sent_flags) == ("00", TRACE_ID, flags)
    assert parent != SENDER_SPAN
