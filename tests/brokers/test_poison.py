"""No message stops a consumer: crafted messages on the real RabbitMQ and NATS, both databases.

Each poison message is sent between two good ones, on one broker, while a
second source (the other broker) runs in the same process: the poison one
is dead-lettered with its reason and counted, both good messages are
stored and acknowledged, and the other source keeps consuming. Then a
bounded hypothesis run publishes arbitrary AMQP properties and headers,
and arbitrary NATS subjects and headers, with the same promise.
"""

from __future__ import annotations

import json
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pika
import pytest
from flask import Flask
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from webhook_receiver.brokers import runner

from .conftest import (
    Queue,
    Stream,
    count_events,
    dead_letter_count,
    duplicate_total,
    nats_source,
    rabbit_source,
    rejections,
    stored_keys,
    wait_until,
)
from .contract import publish_raw

RABBIT = "orders"
NATS = "payments"
MALFORMED = "message-malformed"


def _good(n: int) -> bytes:
    return json.dumps({"n": n}).encode()


def _amqp(key: str | bytes, body: bytes | None = None, **props: Any) -> tuple[bytes, dict]:
    return body or _good(0), {"message_id": key, "content_type": "application/json", **props}


@contextmanager
def _running(app: Flask) -> Iterator[threading.Thread]:
    """Every broker source of ``app`` consumed in one process (as `flask consume` runs them)."""
    stop = threading.Event()
    sources = list(app.config["FILE_CONFIG"].brokers.values())
    thread = threading.Thread(target=runner.run, args=(app, sources, stop), daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive(), "the consumers did not stop"


@pytest.fixture
def both(make_app, amqp_queue: Queue, jetstream: Stream) -> Flask:
    return make_app(
        {
            "sources": {
                RABBIT: rabbit_source(amqp_queue),
                NATS: nats_source(jetstream, dedup_key="header:Nats-Msg-Id"),
            }
        }
    )


def _deep_table(depth: int) -> dict:
    table: dict = {"leaf": 1}
    for _ in range(depth):
        table = {"t": table}
    return table


def _publish_deep(queue: Queue, body: bytes, props: dict) -> None:
    # Encoding 600 levels needs more than Python's default recursion limit,
    # which is what makes pika fail to decode it on the consuming side.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        queue.publish([(body, props)])
    finally:
        sys.setrecursionlimit(limit)


def _publish_routed(queue: Queue, routing_key: bytes, body: bytes, props: dict) -> None:
    # Through a fanout exchange, which routes whatever the routing key.
    exchange = f"{queue.name}.fanout"
    with queue.channel() as ch:
        ch.exchange_declare(exchange, "fanout", auto_delete=True)
        ch.queue_bind(queue.name, exchange)
        ch.confirm_delivery()
        ch.basic_publish(exchange, routing_key, body, pika.BasicProperties(**props))  # type: ignore[arg-type]


RABBIT_POISON: dict[str, Callable[[Queue], None]] = {
    "header-table-key-not-utf8": lambda q: q.publish(
        [_amqp("poison", headers={"t": {b"\xff\xfe": 1}})]
    ),
    "routing-key-not-utf8": lambda q: _publish_routed(q, b"orders.\xff", *_amqp("poison")),
    "header-tables-600-deep": lambda q: _publish_deep(
        q, *_amqp("poison", headers=_deep_table(600))
    ),
    "message-id-not-utf8": lambda q: q.publish([_amqp(b"poison-\xff")]),
}


def _nats_poison(stream: Stream, subject: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    publish_raw(stream.url, stream.prefix.encode() + b"." + subject, headers, _good(0))


NATS_POISON: dict[str, Callable[[Stream], None]] = {
    "subject-not-utf8": lambda s: _nats_poison(s, b"paid\xff", [(b"Nats-Msg-Id", b"poison")]),
    "header-name-with-nul": lambda s: _nats_poison(
        s, b"paid", [(b"Nats-Msg-Id", b"poison"), (b"X-A\x00b", b"1")]
    ),
    "msg-id-not-utf8": lambda s: _nats_poison(s, b"paid", [(b"Nats-Msg-Id", b"poison-\xff")]),
    # The server reads it as one token; nats-py's parser took it for a separator.
    "subject-with-vertical-tab": lambda s: _nats_poison(
        s, b"pa\x0bid", [(b"Nats-Msg-Id", b"poison")]
    ),
    "header-name-not-ascii": lambda s: _nats_poison(
        s, b"paid", [(b"Nats-Msg-Id", b"poison"), ("Ünïcode".encode(), b"1")]
    ),
}


def _nats_good(stream: Stream, n: int) -> None:
    stream.publish([("paid", _good(n), {"Nats-Msg-Id": f"good-{n}"})])


@pytest.mark.parametrize("case", sorted(RABBIT_POISON))
def test_rabbitmq_poison_message_between_two_good_ones(both, amqp_queue, jetstream, case):
    amqp_queue.publish([_amqp("good-1", _good(1))])
    RABBIT_POISON[case](amqp_queue)
    amqp_queue.publish([_amqp("good-2", _good(2))])
    with _running(both) as thread:
        assert wait_until(lambda: count_events(both, RABBIT) == 2, 30)
        assert wait_until(lambda: dead_letter_count(both, RABBIT, MALFORMED) == 1, 30)
        # The other source, in the same process, keeps consuming.
        _nats_good(jetstream, 3)
        assert wait_until(lambda: count_events(both, NATS) == 1, 30)
        assert wait_until(lambda: amqp_queue.ready() == 0, 10)
        assert thread.is_alive()
    assert sorted(stored_keys(both)) == ["good-1", "good-2", "good-3"]
    assert amqp_queue.ready() == 0  # nothing left unacknowledged
    assert amqp_queue.ready(amqp_queue.dead) == 1  # the poison one, dead-lettered
    assert rejections(both, RABBIT) == {MALFORMED: 1}


@pytest.mark.parametrize("case", sorted(NATS_POISON))
def test_nats_poison_message_between_two_good_ones(both, amqp_queue, jetstream, case):
    _nats_good(jetstream, 1)
    NATS_POISON[case](jetstream)
    _nats_good(jetstream, 2)
    with _running(both) as thread:
        assert wait_until(lambda: count_events(both, NATS) == 2, 30)
        assert wait_until(lambda: dead_letter_count(both, NATS, MALFORMED) == 1, 30)
        amqp_queue.publish([_amqp("good-3", _good(3))])
        assert wait_until(lambda: count_events(both, RABBIT) == 1, 30)
        assert wait_until(lambda: jetstream.pending() == (0, 0), 10)
        assert thread.is_alive()
    assert sorted(stored_keys(both)) == ["good-1", "good-2", "good-3"]
    dead = jetstream.dead_letters()
    assert len(dead) == 1
    assert dead[0][1]["Dead-Letter-Reason"] == MALFORMED
    assert rejections(both, NATS) == {MALFORMED: 1}


def test_rabbitmq_ids_that_differ_only_in_invalid_bytes_are_never_one_key(
    both, amqp_queue, jetstream
):
    # Decoded with replacement characters, both would be "id-\ufffd": the first
    # stored, the second acked as its duplicate and lost.
    body = _good(7)
    amqp_queue.publish([_amqp("id-\ufffd", body), _amqp(b"id-\xff", body), _amqp(b"id-\xfe", body)])
    with _running(both):
        assert wait_until(lambda: dead_letter_count(both, RABBIT, MALFORMED) == 2, 30)
        assert wait_until(lambda: amqp_queue.ready() == 0, 10)
    assert stored_keys(both) == ["id-\ufffd"]
    assert duplicate_total(both) == 0
    assert amqp_queue.ready(amqp_queue.dead) == 2


def test_nats_ids_that_differ_only_in_invalid_bytes_are_never_one_key(both, jetstream):
    body = _good(7)
    jetstream.publish([("paid", body, {"Nats-Msg-Id": "id-\ufffd"})])
    for raw in (b"id-\xff", b"id-\xfe"):
        publish_raw(
            jetstream.url, f"{jetstream.prefix}.paid".encode(), [(b"Nats-Msg-Id", raw)], body
        )
    with _running(both):
        assert wait_until(lambda: dead_letter_count(both, NATS, MALFORMED) == 2, 30)
        assert wait_until(lambda: jetstream.pending() == (0, 0), 10)
    assert stored_keys(both) == ["id-\ufffd"]
    assert duplicate_total(both) == 0
    assert len(jetstream.dead_letters()) == 2


def test_a_json_id_sent_as_1_then_as_1_0_is_one_event_and_one_duplicate(make_app, amqp_queue):
    app = make_app({"sources": {RABBIT: rabbit_source(amqp_queue, dedup_key="json:/id")}})
    amqp_queue.publish(
        [
            (b'{"id": 1, "total": 10}', {"content_type": "application/json"}),
            (b'{"id": 1.0, "total": 10.0}', {"content_type": "application/json"}),
        ]
    )
    with _running(app):
        assert wait_until(lambda: duplicate_total(app) == 1, 30)
        assert wait_until(lambda: amqp_queue.ready() == 0, 10)
    assert stored_keys(app) == ["1"]
    assert amqp_queue.ready(amqp_queue.dead) == 0


# -- arbitrary properties, headers and subjects ---------------------------------------

_TEXT = st.text(max_size=12)
_BYTES = st.binary(max_size=12)
_AMQP_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | _TEXT | _BYTES,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(_TEXT | _BYTES.filter(lambda b: len(b) < 256), inner, max_size=3)
    ),
    max_leaves=12,
)
_AMQP_MESSAGES = st.fixed_dictionaries(
    {
        "message_id": _TEXT.filter(bool).map(lambda t: t[:60]) | _BYTES.filter(bool),
        "headers": st.dictionaries(_TEXT | _BYTES, _AMQP_VALUES, max_size=4),
        "type": st.none() | _TEXT | _BYTES,
        "correlation_id": st.none() | _TEXT | _BYTES,
    }
)


_REASONS = (
    MALFORMED,
    "payload-invalid",
    "dedup-key-missing",
    "consumer-error",
    "unstorable",
    "conflict",
)


def _settled_total(app: Flask, source: str) -> float:
    """Messages of ``source`` stored or dead-lettered so far, whatever the reason."""
    dead = sum(dead_letter_count(app, source, reason) for reason in _REASONS)
    return count_events(app, source) + dead


_HYPOTHESIS = settings(
    max_examples=20,
    deadline=None,
    database=None,
    # Each example waits for real brokers: a failure is reported as found, unshrunk.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def test_arbitrary_amqp_properties_and_headers_never_stop_the_consumer(both, amqp_queue):
    marker = iter(range(1_000_000))

    with _running(both) as thread:

        @_HYPOTHESIS
        @given(_AMQP_MESSAGES)
        def check(props: dict[str, Any]) -> None:
            props = {k: v for k, v in props.items() if v is not None and v != {}}
            before = _settled_total(both, RABBIT)
            n = next(marker)
            amqp_queue.publish([(_good(n), props), _amqp(f"marker-{uuid.uuid4().hex}", _good(n))])
            # The crafted message is stored or dead-lettered, and the marker behind it stored.
            assert wait_until(lambda: _settled_total(both, RABBIT) - before >= 2, 20), props
            assert thread.is_alive()

        check()
        assert wait_until(lambda: amqp_queue.ready() == 0, 10)


_TOKEN = st.binary(min_size=1, max_size=8).filter(
    lambda b: not any(c in b for c in b" \t\r\n.*>\x00")
)
_HEADER_NAME = st.binary(min_size=1, max_size=10).filter(
    lambda b: not any(c in b for c in b" \t\r\n:") and b.strip() == b
)
_HEADER_VALUE = st.binary(max_size=12).filter(lambda b: b"\r" not in b and b"\n" not in b)


def test_arbitrary_nats_subjects_and_headers_never_stop_the_consumer(both, jetstream):
    with _running(both) as thread:

        @_HYPOTHESIS
        @given(_TOKEN, st.lists(st.tuples(_HEADER_NAME, _HEADER_VALUE), max_size=4), _BYTES)
        def check(token: bytes, headers: list[tuple[bytes, bytes]], msg_id: bytes) -> None:
            before = _settled_total(both, NATS)
            subject = jetstream.prefix.encode() + b"." + token
            # Unique, or JetStream's duplicate window would drop a repeated example.
            msg_id += uuid.uuid4().hex.encode()
            publish_raw(jetstream.url, subject, [(b"Nats-Msg-Id", msg_id), *headers], b"{}")
            _nats_good(jetstream, uuid.uuid4().int % 10**9)
            assert wait_until(lambda: _settled_total(both, NATS) - before >= 2, 20), (
                token,
                headers,
                msg_id,
            )
            assert thread.is_alive()

        check()
        assert wait_until(lambda: jetstream.pending() == (0, 0), 10)
