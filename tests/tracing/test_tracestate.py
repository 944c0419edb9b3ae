"""W3C ``tracestate``: kept beside the event's ``traceparent``, and sent on with it.

A sender's tracestate (a vendor's trace data, e.g. its sampling decision)
goes into the event's meta through each intake (webhook, API, a RabbitMQ
header) when its traceparent is valid and kept; the worker's attempt
continues the trace under it and the forward to a real HTTP downstream
sends it. One that is malformed or past W3C's 512 characters (or 32
list-members) is dropped whole while the event is stored; one without a
valid traceparent is not kept.
"""

from __future__ import annotations

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

from ..brokers.conftest import consuming, count_events, rabbit_source, wait_until
from ..conftest import bearer
from ..helpers.signing import hmac_hex
from ..processing.conftest import FAST, SOURCE, config_with, drain, forward

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SENDER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{SENDER_SPAN}-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def _webhook(app, key: str, **trace_headers: str) -> Any:
    body = json.dumps({"type": "order.paid", "id": key}).encode()
    headers = {
        "Content-Type": "application/json",
        "X-Signature": f"sha256={hmac_hex(body, 'shop-secret-0123456789')}",
        "Idempotency-Key": key,
        **trace_headers,
    }
    answer = app.test_client().post(f"/webhooks/{SOURCE}", data=body, headers=headers)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    return answer


def _stored_meta(app) -> dict[str, Any]:
    with app.app_context():
        meta: dict[str, Any] = db.session.scalars(select(Event.meta)).one()
    return meta


def _forwarded(app, downstream, clock, make_worker) -> dict[str, str]:
    """Run the worker until the event is forwarded; the forward's request headers."""
    clock.now = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    (call,) = downstream.calls_to("/sink")
    return {name.lower(): value for name, value in call.headers.items()}


def _assert_sent_on(sent: dict[str, str], tracestate: str) -> None:
    version, trace_id, _, flags = sent["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert sent["tracestate"] == tracestate


def test_a_webhooks_tracestate_is_stored_and_forwarded(make_app, downstream, clock, make_worker):
    app = make_app(config_with([forward("sink", downstream.url + "/sink")]), **FAST)
    _webhook(app, "k-1", traceparent=TRACEPARENT, tracestate=TRACESTATE)
    meta = _stored_meta(app)
    assert meta["traceparent"] == TRACEPARENT
    assert meta["tracestate"] == TRACESTATE
    _assert_sent_on(_forwarded(app, downstream, clock, make_worker), TRACESTATE)


def test_an_api_events_tracestate_is_stored_and_forwarded(make_app, downstream, clock, make_worker):
    config = config_with(client_forwards=[forward("sink", downstream.url + "/sink")])
    app = make_app(config, **FAST)
    headers = {
        **bearer(),
        "Idempotency-Key": "api-1",
        "traceparent": TRACEPARENT,
        "tracestate": TRACESTATE,
    }
    answer = app.test_client().post(
        "/api/events", json={"type": "order.paid", "data": {"id": 1}}, headers=headers
    )
    assert answer.status_code == 201, answer.get_data(as_text=True)
    meta = _stored_meta(app)
    assert (meta["traceparent"], meta["tracestate"]) == (TRACEPARENT, TRACESTATE)
    _assert_sent_on(_forwarded(app, downstream, clock, make_worker), TRACESTATE)


def test_repeated_tracestate_headers_are_one_list(make_app):
    app = make_app(config_with())
    body = json.dumps({"type": "order.paid", "id": 4}).encode()
    headers = [
        ("Content-Type", "application/json"),
        ("X-Signature", f"sha256={hmac_hex(body, 'shop-secret-0123456789')}"),
        ("Idempotency-Key", "k-4"),
        ("traceparent", TRACEPARENT),
        ("tracestate", "congo=t61rcWkgMzE"),
        ("tracestate", "rojo=00f067aa0ba902b7 ,"),
    ]
    answer = app.test_client().post(f"/webhooks/{SOURCE}", data=body, headers=headers)
    assert answer.status_code == 200
    # Combined with commas (RFC 9110), the blanks and the empty member W3C allows left out.
    assert _stored_meta(app)["tracestate"] == TRACESTATE


# The longest list W3C allows: 512 characters.
LONGEST = ",".join(f"k{n:02}=" + "v" * (12 if n == 0 else 11) for n in range(32))


def test_a_tracestate_of_512_characters_and_32_members_is_kept(make_app):
    assert len(LONGEST) == 512
    app = make_app(config_with())
    _webhook(app, "k-5", traceparent=TRACEPARENT, tracestate=LONGEST)
    assert _stored_meta(app)["tracestate"] == LONGEST


@pytest.mark.parametrize(
    "value",
    [
        LONGEST + "v",  # 513 characters
        ",".join(f"k{n:02}=v" for n in range(33)),  # 33 members, 197 characters
        "congo=t61rcWkgMzE,Rojo=1",  # an upper-case key
        "congo=t61rcWkgMzE,rojo",  # no value
        "congo=a=b",  # "=" in a value
        "congo=1,congo=2",  # a key twice
        "congo=caf\u00e9",  # past ASCII
        "congo=",  # an empty value
    ],
)
def test_an_invalid_tracestate_is_dropped_and_refuses_nothing(
    make_app, downstream, clock, make_worker, value
):
    app = make_app(config_with([forward("sink", downstream.url + "/sink")]), **FAST)
    _webhook(app, "k-6", traceparent=TRACEPARENT, tracestate=value)
    meta = _stored_meta(app)
    assert meta["traceparent"] == TRACEPARENT
    assert "tracestate" not in meta
    sent = _forwarded(app, downstream, clock, make_worker)
    assert sent["traceparent"].split("-")[1] == TRACE_ID
    assert "tracestate" not in sent


@pytest.mark.parametrize("traceparent", [None, f"ff-{TRACE_ID}-{SENDER_SPAN}-01"])
def test_a_tracestate_without_a_valid_traceparent_is_not_kept(
    make_app, downstream, clock, make_worker, traceparent
):
    app = make_app(config_with([forward("sink", downstream.url + "/sink")]), **FAST)
    trace_headers = {"tracestate": TRACESTATE}
    if traceparent is not None:
        trace_headers["traceparent"] = traceparent
    _webhook(app, "k-7", **trace_headers)
    meta = _stored_meta(app)
    assert "traceparent" not in meta
    assert "tracestate" not in meta
    assert "tracestate" not in _forwarded(app, downstream, clock, make_worker)


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    named: dict[str, ReadableSpan] = {}
    for span in spans:
        named.setdefault(span.name, span)
    return named


def test_traced_the_receipts_span_the_attempt_and_the_forward_carry_it(
    make_app, downstream, clock, make_worker
):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = config_with([forward("sink", downstream.url + "/sink")])
    app = make_app(config, OTEL_TRACER_PROVIDER=provider, **FAST)
    _webhook(app, "k-8", traceparent=TRACEPARENT, tracestate="congo=t61rcWkgMzE, rojo=1")
    assert _stored_meta(app)["tracestate"] == "congo=t61rcWkgMzE,rojo=1"
    sent = _forwarded(app, downstream, clock, make_worker)
    spans = _by_name(exporter.get_finished_spans())
    server = next(s for s in spans.values() if s.kind.name == "SERVER")
    for span in (server, spans["delivery attempt"], spans["forward"]):
        assert dict(span.context.trace_state) == {"congo": "t61rcWkgMzE", "rojo": "1"}, span.name
    forward_span = format(spans["forward"].context.span_id, "016x")
    assert sent["traceparent"] == f"00-{TRACE_ID}-{forward_span}-01"
    assert sent["tracestate"] == "congo=t61rcWkgMzE,rojo=1"


def test_an_amqp_header_tracestate_is_stored_and_forwarded(
    make_app, amqp_queue, downstream, clock, make_worker
):
    source = rabbit_source(amqp_queue, forward=[forward("sink", downstream.url + "/sink")])
    app = make_app({"sources": {"orders": source}}, **FAST)
    props: dict[str, Any] = {
        "message_id": "m-1",
        "type": "order.paid",
        "content_type": "application/json",
        "headers": {"traceparent": TRACEPARENT, "tracestate": TRACESTATE},
    }
    amqp_queue.publish([(b'{"order": 1}', props)])
    with consuming(app, "orders"):
        assert wait_until(lambda: count_events(app) == 1, 30)
    meta = _stored_meta(app)
    assert (meta["traceparent"], meta["tracestate"]) == (TRACEPARENT, TRACESTATE)
    _assert_sent_on(_forwarded(app, downstream, clock, make_worker), TRACESTATE)


def test_a_forward_to_rabbitmq_carries_it_as_a_header(make_app, amqp_queue, clock, make_worker):
    bus = forward("bus", amqp_queue.url, exchange="", routing_key=amqp_queue.name)
    app = make_app(config_with([bus]), **FAST)
    _webhook(app, "k-9", traceparent=TRACEPARENT, tracestate=TRACESTATE)
    clock.now = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    [(props, _)] = amqp_queue.take_all(amqp_queue.name)
    assert props.headers["traceparent"].split("-")[1] == TRACE_ID
    assert props.headers["tracestate"] == TRACESTATE
