"""Traces: one trace from the intake's traceparent, through the inbox and the worker, onward.

Each test gives the app a tracer provider with an in-memory exporter (the
``OTEL_TRACER_PROVIDER`` setting), sends a message carrying a sender's
``traceparent`` through a real intake (HTTP, RabbitMQ, NATS JetStream), runs
the worker against a real HTTP downstream, and reads the spans: every one
is in the sender's trace, each under its parent, and the forward's outgoing
``traceparent`` names the forward's span. Without a provider nothing is
traced, and the stored traceparent still goes onward.
"""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select

from webhook_receiver.extensions import db
from webhook_receiver.models import Event

from ..brokers.conftest import consuming, count_events, nats_source, rabbit_source, wait_until
from ..helpers.signing import hmac_hex
from ..processing.conftest import FAST, SOURCE, config_with, drain, forward

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SENDER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{SENDER_SPAN}-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def _provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _hex(value: int, digits: int) -> str:
    return format(value, f"0{digits}x")


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    named: dict[str, ReadableSpan] = {}
    for span in spans:
        named.setdefault(span.name, span)
    return named


def _parent_of(span: ReadableSpan) -> str | None:
    return None if span.parent is None else _hex(span.parent.span_id, 16)


def _id_of(span: ReadableSpan) -> str:
    return _hex(span.context.span_id, 16)


def _deliver(app, downstream, clock, make_worker) -> dict[str, str]:
    """Run the worker until the event is forwarded; the forward's request headers."""
    clock.now = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    (call,) = downstream.calls_to("/sink")
    return {name.lower(): value for name, value in call.headers.items()}


def _assert_attempt_continues(
    spans: dict[str, ReadableSpan], received_under: str, outgoing: str
) -> None:
    """The attempt is the receipt's child, the forward the attempt's, the request the forward's."""
    attempt, sent = spans["delivery attempt"], spans["forward"]
    for span in (attempt, sent):
        assert _hex(span.context.trace_id, 32) == TRACE_ID
    assert _parent_of(attempt) == received_under
    assert _parent_of(sent) == _id_of(attempt)
    assert attempt.attributes["consumer"] == "sink"
    assert attempt.attributes["outcome"] == "delivered"
    assert outgoing == f"00-{TRACE_ID}-{_id_of(sent)}-01"


def test_a_webhook_receipt_the_inbox_the_attempt_and_the_forward_are_one_trace(
    make_app, downstream, clock, make_worker, exporter
):
    config = config_with([forward("sink", downstream.url + "/sink")])
    app = make_app(config, OTEL_TRACER_PROVIDER=_provider(exporter), **FAST)
    body = json.dumps({"type": "order.paid", "id": 1}).encode()
    headers = {
        "Content-Type": "application/json",
        "X-Signature": f"sha256={hmac_hex(body, 'shop-secret-0123456789')}",
        "Idempotency-Key": "k-1",
        "traceparent": TRACEPARENT,
    }
    answer = app.test_client().post(f"/webhooks/{SOURCE}", data=body, headers=headers)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    outgoing = _deliver(app, downstream, clock, make_worker)["traceparent"]
    spans = _by_name(exporter.get_finished_spans())
    server = next(s for s in spans.values() if s.kind.name == "SERVER")
    assert _hex(server.context.trace_id, 32) == TRACE_ID
    assert _parent_of(server) == SENDER_SPAN
    assert server.name == "POST /webhooks/<source_name>"
    assert server.attributes is not None
    assert server.attributes["http.request.method"] == "POST"
    assert server.attributes["http.route"] == "/webhooks/<source_name>"
    assert server.attributes["url.path"] == f"/webhooks/{SOURCE}"
    assert server.attributes["http.response.status_code"] == 200
    inbox_span = spans["inbox receive"]
    assert _parent_of(inbox_span) == _id_of(server)
    assert inbox_span.attributes["dedup_key"] == "k-1"
    with app.app_context():
        stored = db.session.scalars(select(Event.meta)).one()
    # The event keeps the receipt's span as its parent: the attempt continues there.
    assert stored["traceparent"] == f"00-{TRACE_ID}-{_id_of(server)}-01"
    _assert_attempt_continues(spans, _id_of(server), outgoing)


def test_an_amqp_header_traceparent_reaches_the_forward(
    make_app, amqp_queue, downstream, clock, make_worker, exporter
):
    source = rabbit_source(amqp_queue, forward=[forward("sink", downstream.url + "/sink")])
    app = make_app(
        {"sources": {"orders": source}}, OTEL_TRACER_PROVIDER=_provider(exporter), **FAST
    )
    props: dict[str, Any] = {
        "message_id": "m-1",
        "type": "order.paid",
        "content_type": "application/json",
        "headers": {"traceparent": TRACEPARENT},
    }
    amqp_queue.publish([(b'{"order": 1}', props)])
    with consuming(app, "orders"):
        assert wait_until(lambda: count_events(app) == 1, 30)
    outgoing = _deliver(app, downstream, clock, make_worker)["traceparent"]
    spans = _by_name(exporter.get_finished_spans())
    assert spans["broker batch"].attributes["messages"] == 1
    # A broker batch holds many traces: each message's attempt continues the sender's.
    _assert_attempt_continues(spans, SENDER_SPAN, outgoing)


def test_a_nats_header_traceparent_reaches_the_forward(
    make_app, jetstream, downstream, clock, make_worker, exporter
):
    source = nats_source(jetstream, forward=[forward("sink", downstream.url + "/sink")])
    app = make_app(
        {"sources": {"orders": source}}, OTEL_TRACER_PROVIDER=_provider(exporter), **FAST
    )
    headers = {"Nats-Msg-Id": "m-1", "traceparent": TRACEPARENT}
    jetstream.publish([(f"{jetstream.prefix}.order.paid", b'{"order": 1}', headers)])
    with consuming(app, "orders"):
        assert wait_until(lambda: count_events(app) == 1, 30)
    outgoing = _deliver(app, downstream, clock, make_worker)["traceparent"]
    _assert_attempt_continues(_by_name(exporter.get_finished_spans()), SENDER_SPAN, outgoing)


def test_untraced_the_stored_traceparent_still_goes_onward(
    make_app, downstream, clock, make_worker
):
    config = config_with([forward("sink", downstream.url + "/sink")])
    app = make_app(config, **FAST)
    body = json.dumps({"type": "order.paid", "id": 2}).encode()
    headers = {
        "Content-Type": "application/json",
        "X-Signature": f"sha256={hmac_hex(body, 'shop-secret-0123456789')}",
        "Idempotency-Key": "k-2",
        "traceparent": TRACEPARENT,
        # A correlation id of its own: the trace is the stored traceparent's.
        "X-Request-Id": "req-2",
    }
    assert (
        app.test_client().post(f"/webhooks/{SOURCE}", data=body, headers=headers).status_code == 200
    )
    outgoing = _deliver(app, downstream, clock, make_worker)["traceparent"]
    version, trace_id, parent, flags = outgoing.split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert parent != SENDER_SPAN  # a new parent id: the forward is another hop


@pytest.mark.parametrize(
    "value",
    [
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        f"00-{TRACE_ID}-0000000000000000-01",
        "not a traceparent",
        f"00-{TRACE_ID.upper()}x-{SENDER_SPAN}-01",
        f"ff-{TRACE_ID}-{SENDER_SPAN}-01",  # W3C: version ff is invalid
    ],
)
def test_an_invalid_traceparent_is_left_out_and_refuses_nothing(make_app, value):
    app = make_app(config_with())
    body = json.dumps({"type": "order.paid", "id": 3}).encode()
    headers = {
        "Content-Type": "application/json",
        "X-Signature": f"sha256={hmac_hex(body, 'shop-secret-0123456789')}",
        "Idempotency-Key": "k-3",
        "traceparent": value,
    }
    answer = app.test_client().post(f"/webhooks/{SOURCE}", data=body, headers=headers)
    assert answer.status_code == 200
    with app.app_context():
        event = db.session.scalars(select(Event)).one()
        assert "traceparent" not in event.meta
    # Nor is its trace id the correlation id: a forward would carry that
    # trace onward (tracing.outgoing) as if the traceparent had been valid.
    assert answer.headers["X-Request-Id"] != TRACE_ID
    assert event.correlation_id == answer.headers["X-Request-Id"]


def test_a_refused_request_has_its_server_span_and_a_probe_has_none(make_app, exporter):
    app = make_app(config_with(), OTEL_TRACER_PROVIDER=_provider(exporter))
    client = app.test_client()
    answer = client.post(
        "/webhooks/no-such-source", data=b"{}", headers={"traceparent": TRACEPARENT}
    )
    assert answer.status_code == 404
    (server,) = exporter.get_finished_spans()
    assert server.kind.name == "SERVER"
    assert _parent_of(server) == SENDER_SPAN
    assert server.attributes is not None
    assert server.attributes["http.response.status_code"] == 404
    assert server.status.status_code.name == "UNSET"  # a client's error is not the server's
    exporter.clear()
    assert client.get("/healthz").status_code == 200
    assert exporter.get_finished_spans() == ()


def test_a_chunked_body_refused_before_any_view_has_its_server_span(make_app, exporter):
    # problems.py reads a chunked body in the app's first before_request and
    # refuses one over the limit there; the server span started in a later
    # one, so the 413 went untraced, the sender's trace ending at our door.
    app = make_app(config_with(), MAX_BODY_BYTES=1024, OTEL_TRACER_PROVIDER=_provider(exporter))
    answer = app.test_client().post(
        f"/webhooks/{SOURCE}",
        input_stream=io.BytesIO(b"x" * 4096),
        headers={"Transfer-Encoding": "chunked", "traceparent": TRACEPARENT},
        # What a server sets when it has undone the chunks (gunicorn does).
        environ_overrides={"wsgi.input_terminated": True},
    )
    assert answer.status_code == 413
    (server,) = exporter.get_finished_spans()
    assert server.kind.name == "SERVER"
    assert _parent_of(server) == SENDER_SPAN
    assert server.attributes is not None
    assert server.attributes["http.response.status_code"] == 413
    assert server.attributes["http.route"] == "/webhooks/<source_name>"


def test_a_method_of_the_clients_own_does_not_name_the_server_span(make_app, exporter):
    # Span names are indexed by tracing back ends (an operation each): a name
    # made of any token a client sends as its method grows without bound.
    # HTTP's semantic conventions name such a span "HTTP" and set the method
    # "_OTHER", the token as sent in http.request.method_original.
    app = make_app(config_with(), OTEL_TRACER_PROVIDER=_provider(exporter))
    client = app.test_client()
    for method in ("BREW", "X-RANDOM-1F3A"):
        assert client.open(f"/webhooks/{SOURCE}", method=method).status_code == 405
    spans = exporter.get_finished_spans()
    assert [span.name for span in spans] == ["HTTP", "HTTP"]
    assert [span.attributes["http.request.method"] for span in spans] == ["_OTHER"] * 2
    assert [span.attributes["http.request.method_original"] for span in spans] == [
        "BREW",
        "X-RANDOM-1F3A",
    ]
    exporter.clear()
    assert client.get("/no/such/page").status_code == 404
    (known,) = exporter.get_finished_spans()
    assert known.name == "GET"
    assert known.attributes["http.request.method"] == "GET"
    assert "http.request.method_original" not in known.attributes
