"""The SQS consumer beyond the contract suite: visibility, redrive, FIFO queues, what is stored.

Against moto's server (tests/sqs_server.py), on both databases. The
contract suite (test_contract.py) holds it to every broker's promises.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import select

from webhook_receiver import config as cfg
from webhook_receiver.config.forwards import parse_forwards
from webhook_receiver.extensions import db
from webhook_receiver.models import Event
from webhook_receiver.processing import publishers

from ..helpers import brokers as shared
from ..helpers import rows
from ..helpers.brokers import FORWARDED
from . import cloud_examples
from .cloud_fixtures import SqsQueue, sqs_source
from .conftest import (
    consuming,
    count_events,
    dead_letter_count,
    duplicate_total,
    rejections,
    wait_until,
)
from .running import hold_writers
from .test_poison import _HYPOTHESIS, _settled_total

SOURCE = "jobs"


def _entry(key: str | None, body: bytes, **attributes: str) -> dict[str, Any]:
    values = {"type": "order", **attributes}
    if key is not None:
        values["message-id"] = key
    return {
        "MessageBody": body.decode(),
        "MessageAttributes": {
            name: {"DataType": "String", "StringValue": value} for name, value in values.items()
        },
    }


def _body(n: int) -> bytes:
    return json.dumps({"n": n}).encode()


def test_a_batch_slower_than_half_the_visibility_timeout_keeps_its_messages_hidden(
    make_app, db_url, sqs_queue: SqsQueue, caplog
):
    # A 2 s visibility timeout, and a store held for 5 s: extended at half
    # of it, the messages never reappear (moto would show them visible).
    sqs_queue.set_visibility(2)
    app = make_app({"sources": {SOURCE: sqs_source(sqs_queue, batch=20)}})
    caplog.set_level(logging.INFO, "webhook_receiver.brokers.leases")
    release = hold_writers(db_url)
    try:
        with consuming(app, SOURCE):
            sqs_queue.send([_entry(f"m-{n}", _body(n)) for n in range(20)])
            assert wait_until(lambda: sqs_queue.counts() == (0, 20), 15)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                assert sqs_queue.counts() == (0, 20)  # none visible again, none received twice
                time.sleep(0.2)
            assert count_events(app) == 0
            release()
            release = None
            assert wait_until(lambda: count_events(app) == 20, 30)
            assert wait_until(lambda: sqs_queue.counts() == (0, 0), 15)
    finally:
        if release is not None:
            release()
    assert duplicate_total(app) == 0
    assert "held past half their visibility timeout" in caplog.text


def test_without_a_dead_letter_queue_a_poison_message_is_left_to_the_redrive_policy(
    make_app, sqs_endpoint
):
    # The queue's own redrive policy moves it after two receives; the
    # consumer stores the good ones and deletes nothing it did not store.
    queue = SqsQueue(sqs_endpoint, f"wr-test-redrive-{time.monotonic_ns() % 10**9}")
    queue.create(visibility=1)
    try:
        sqs = queue.client()
        arn = sqs.get_queue_attributes(QueueUrl=queue.dead_url, AttributeNames=["QueueArn"])
        policy = {"deadLetterTargetArn": arn["Attributes"]["QueueArn"], "maxReceiveCount": 2}
        sqs.set_queue_attributes(
            QueueUrl=queue.url, Attributes={"RedrivePolicy": json.dumps(policy)}
        )
        source = sqs_source(queue)
        del source["dead_letter_queue_url"]
        app = make_app({"sources": {SOURCE: source}})
        queue.send([_entry("m-1", _body(1)), _entry(None, b'{"n": 0}'), _entry("m-2", _body(2))])
        with consuming(app, SOURCE):
            assert wait_until(lambda: count_events(app) == 2, 30)
            assert wait_until(lambda: queue.counts(queue.dead_url)[0] == 1, 30)
            assert wait_until(lambda: queue.counts() == (0, 0), 10)
        [dead] = queue.receive_all(queue.dead_url)
        assert dead["Body"] == '{"n": 0}'
        assert "dead-letter-reason" not in dead["MessageAttributes"]  # SQS moved it, unchanged
        assert dead_letter_count(app, SOURCE, "dedup-key-missing") == 0  # not the consumer's
    finally:
        queue.delete()


def test_a_fifo_queue_keyed_by_its_deduplication_ids(make_app, sqs_endpoint):
    queue = SqsQueue(sqs_endpoint, f"wr-test-fifo-{time.monotonic_ns() % 10**9}", fifo=True)
    queue.create()
    try:
        source = sqs_source(queue, dedup_key="deduplication_id", event_type="json:/type")
        app = make_app({"sources": {SOURCE: source}})
        entries = [
            {"MessageBody": '{"type": "paid", "n": 1}', "MessageDeduplicationId": "d-1"},
            {"MessageBody": "not json", "MessageDeduplicationId": "d-2"},
            {"MessageBody": '{"type": "paid", "n": 3}', "MessageDeduplicationId": "d-3"},
            # SQS itself drops this one: the same id within its five minutes.
            {"MessageBody": '{"type": "paid", "n": 1}', "MessageDeduplicationId": "d-1"},
        ]
        queue.send([{"MessageGroupId": "orders", **e} for e in entries])
        with consuming(app, SOURCE):
            assert wait_until(lambda: count_events(app) == 2, 30)
            assert wait_until(lambda: dead_letter_count(app, SOURCE, "payload-invalid") == 1, 30)
            assert wait_until(lambda: queue.counts() == (0, 0), 10)
        with app.app_context():
            rows = db.session.execute(select(Event.dedup_key, Event.event_type)).all()
        assert sorted(rows) == [("d-1", "paid"), ("d-3", "paid")]
        [dead] = queue.receive_all(queue.dead_url)
        assert dead["Body"] == "not json"
        assert dead["Attributes"]["MessageGroupId"] == "orders"
        assert dead["MessageAttributes"]["dead-letter-reason"]["StringValue"] == "payload-invalid"
    finally:
        queue.delete()


def test_what_is_stored_of_a_message_its_attributes_and_where_it_came_from(
    make_app, sqs_queue: SqsQueue
):
    app = make_app({"sources": {SOURCE: sqs_source(sqs_queue)}})
    entry = _entry("m-1", _body(1), **{"content-type": "application/json", "tenant": "acme"})
    entry["MessageAttributes"]["blob"] = {"DataType": "Binary", "BinaryValue": b"\xff\x00"}
    sqs_queue.send([entry])
    event = shared.consume_one(app, SOURCE)
    assert (event.dedup_key, event.event_type, event.content_type) == (
        "m-1",
        "order",
        "application/json",
    )
    headers = dict(event.headers)
    assert headers["tenant"] == "acme"
    assert headers["blob"] == "base64:/wA="  # kept exactly
    assert event.meta["broker"] == "sqs"
    assert event.meta["queue_url"] == sqs_queue.url
    assert event.meta["message_id"] == event.meta["properties"]["message_id"]
    assert "SentTimestamp" in event.meta["attributes"]
    assert "ApproximateReceiveCount" not in event.meta["attributes"]  # changes per receive


URL = "https://sqs.eu-west-1.amazonaws.com/123456789012/jobs"


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ({"queue_url": "jobs"}, "queue_url must be a queue's URL"),
        ({"queue_url": URL, "dedup_key": "deduplication_id"}, "FIFO queues"),
        (
            {"queue_url": URL + ".fifo", "dead_letter_queue_url": URL + "-dead"},
            "must be a FIFO queue",
        ),
        ({"queue_url": URL, "dead_letter_queue_url": URL}, "is the queue itself"),
        ({"queue_url": "http://127.0.0.1:4566/1/jobs"}, "region must be an AWS region"),
        ({"queue_url": URL, "event_type": "message_id"}, "is a dedup key, not an event type"),
        ({"queue_url": URL, "dedup_key": "header:Id"}, "'attribute:<name>'"),
        ({"queue_url": URL, "endpoint_url": "localhost:4566"}, "endpoint_url must be"),
        ({"queue_url": URL, "batch": 5000}, "batch must be at most 1000"),
        ({"queue_url": URL, "queue": "jobs"}, "unknown key(s) for provider sqs: queue"),
    ],
)
def test_a_wrong_sqs_source_is_refused_with_a_line_naming_it(table, problem):
    shared.assert_source_refused(problem, provider="sqs", **table)


def test_the_issue_s_sqs_source_reads_its_region_from_the_url():
    source = shared.parse_source(
        provider="sqs",
        queue_url=URL,
        endpoint_url="",
        event_type="attribute:type",
        dead_letter_queue_url="",
    ).brokers["jobs"]
    assert (source.region, source.queue, source.batch, source.dedup_key) == (
        "eu-west-1",
        "jobs",
        10,
        "message_id",
    )
    assert source.endpoint_url is None and source.dead_letter_queue_url is None


def test_the_docs_worked_example_runs_as_written(make_app, sqs_endpoint):
    name, table, commands = cloud_examples.example("Amazon SQS")
    queue = SqsQueue(sqs_endpoint, f"wr-test-{uuid.uuid4().hex[:10]}")
    account = f"{sqs_endpoint}/123456789012"
    table = {
        **table,
        "queue_url": f"{account}/{queue.name}",
        "dead_letter_queue_url": f"{account}/{queue.dead}",
        "endpoint_url": sqs_endpoint,
    }
    queue.url, queue.dead_url = table["queue_url"], table["dead_letter_queue_url"]
    swap = {"'jobs-dead'": f"'{queue.dead}'", "'jobs'": f"'{queue.name}'"}
    app = make_app({"sources": {name: table}})
    try:
        shared.run_cloud_example(app, name, commands, swap)
        assert queue.counts() == (0, 0)
    finally:
        queue.delete()


def test_publish_refuses_a_key_where_sqs_gives_the_message_its_id(make_app, sqs_queue):
    source = sqs_source(sqs_queue)
    del source["dedup_key"]
    app = make_app({"sources": {SOURCE: source}})
    result = shared.publish_order(app, SOURCE)
    assert result.exit_code == 2
    assert "publish without --key" in result.output
    assert sqs_queue.counts() == (0, 0)


def test_publish_to_a_queue_never_declared_is_one_line_and_exit_status_1(make_app, sqs_queue):
    source = sqs_source(sqs_queue, queue_url=sqs_queue.url + "-missing")
    app = make_app({"sources": {SOURCE: source}})
    shared.assert_not_declared(shared.publish_order(app, SOURCE), SOURCE)


def _forward(endpoint: str, queue_url: str) -> Any:
    path = queue_url.removeprefix(endpoint)
    table = {"name": "bus", "url": f"sqs://sqs.eu-west-1.amazonaws.com{path}"}
    [forward] = parse_forwards([{**table, "endpoint_url": endpoint}], "test")
    return forward


def test_a_forward_sends_a_message_that_an_sqs_source_reads_as_one_event(make_app, sqs_queue):
    forward = _forward(sqs_queue.endpoint, sqs_queue.url)
    publishers.publish(forward, FORWARDED)
    publishers.publish(forward, FORWARDED)  # a worker killed before marking it done
    assert sqs_queue.counts() == (2, 0)
    source = sqs_source(sqs_queue)
    del source["dedup_key"], source["event_type"]
    table = {**source, "dedup_key": "attribute:message-id", "event_type": "attribute:type"}
    app = make_app({"sources": {SOURCE: table}})
    with consuming(app, SOURCE):
        assert wait_until(lambda: duplicate_total(app) == 1, 30)
        assert wait_until(lambda: sqs_queue.counts() == (0, 0), 10)
    [event] = rows(app)
    shared.assert_forwarded(event)


def test_a_forward_to_a_fifo_queue_is_sent_once_within_its_deduplication_window(sqs_endpoint):
    queue = SqsQueue(sqs_endpoint, f"wr-test-fifo-{uuid.uuid4().hex[:8]}", fifo=True)
    queue.create()
    try:
        forward = _forward(sqs_endpoint, queue.url)
        long_key = FORWARDED.message_id + ":" + "k" * 200  # past SQS's 128: its SHA-256
        for message_id in (
            FORWARDED.message_id,
            FORWARDED.message_id,
            long_key,
            long_key,
        ):
            publishers.publish(forward, dataclasses.replace(FORWARDED, message_id=message_id))
        messages = queue.receive_all(queue.url)
        assert [m["MessageAttributes"]["message-id"]["StringValue"] for m in messages] == [
            FORWARDED.message_id,
            long_key,
        ]
        assert {m["Attributes"]["MessageGroupId"] for m in messages} == {"stripe"}
    finally:
        queue.delete()


def test_a_forward_sqs_cannot_take_goes_dead_and_one_it_cannot_reach_is_retried(sqs_queue):
    forward = _forward(sqs_queue.endpoint, sqs_queue.url)
    with pytest.raises(publishers.PublishRefused):
        publishers.publish(forward, dataclasses.replace(FORWARDED, body=b"\xff\xfe"))
    missing = _forward(sqs_queue.endpoint, sqs_queue.url + "-missing")
    with pytest.raises(publishers.PublishError) as failed:
        publishers.publish(missing, FORWARDED)
    assert not isinstance(failed.value, publishers.PublishRefused)
    assert sqs_queue.counts() == (0, 0)


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ({"url": "sqs://sqs.eu-west-1.amazonaws.com/jobs"}, "sqs://<host>/<account>/<queue>"),
        ({"url": "sqs://127.0.0.1:4566/1/jobs"}, "region must be an AWS region"),
        (
            {"url": URL.replace("https", "sqs"), "endpoint_url": "127.0.0.1"},
            "endpoint_url must be",
        ),
        ({"url": URL.replace("https", "sqs"), "stream": "x"}, "unknown key(s): stream"),
    ],
)
def test_a_wrong_sqs_forward_is_refused(table, problem):
    with pytest.raises(cfg.ConfigError) as refused:
        parse_forwards([{"name": "bus", **table}], "test")
    assert problem in str(refused.value)


# SQS's own alphabet for text (#x9, #xA, #xD, #x20 to #xD7FF, #xE000 to #xFFFD, beyond #xFFFF).
_SQS_TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",), min_codepoint=0x20).filter(
        lambda c: c not in "\ufffe\uffff"
    )
    | st.sampled_from("\t\n\r"),
    min_size=1,
    max_size=12,
)
_SQS_VALUE = st.one_of(
    _SQS_TEXT.map(lambda t: {"DataType": "String", "StringValue": t}),
    st.binary(min_size=1, max_size=12).map(lambda b: {"DataType": "Binary", "BinaryValue": b}),
)
_SQS_MESSAGES = st.fixed_dictionaries(
    {
        "MessageBody": _SQS_TEXT,
        "MessageAttributes": st.dictionaries(
            st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True), _SQS_VALUE, max_size=4
        ),
    }
)


def test_arbitrary_bodies_and_attributes_never_stop_the_consumer(make_app, sqs_queue):
    app = make_app({"sources": {SOURCE: sqs_source(sqs_queue)}})
    with consuming(app, SOURCE):

        @_HYPOTHESIS
        @given(_SQS_MESSAGES, _SQS_VALUE)
        def check(entry: dict[str, Any], key: dict[str, Any]) -> None:
            entry["MessageAttributes"]["message-id"] = key
            before = _settled(app)
            marker = _entry(f"marker-{uuid.uuid4().hex}", _body(0))
            sqs_queue.send([entry, marker])
            # The crafted message is stored or dead-lettered, and the marker behind it stored.
            assert wait_until(lambda: _settled(app) - before >= 2, 20), entry

        check()
        assert wait_until(lambda: sqs_queue.counts() == (0, 0), 10)


def _settled(app: Any) -> float:
    """Messages stored, counted as duplicates (an example may repeat one) or dead-lettered."""
    return _settled_total(app, SOURCE) + duplicate_total(app)


def test_dead_letters_too_large_for_one_send_message_batch_are_sent_all_the_same(
    make_app, sqs_queue: SqsQueue
):
    # Four poison messages of 300 KB: each one SQS takes, but not the four in
    # one SendMessageBatch (its total is capped as one message is, 1 MiB).
    # Sent in one call, the copies were refused together and retried so, for
    # ever: none reached the dead-letter queue.
    big = [_entry(None, json.dumps({"n": n, "pad": "x" * 300_000}).encode()) for n in range(4)]
    for entry in big:
        sqs_queue.send([entry])
    app = make_app({"sources": {SOURCE: sqs_source(sqs_queue, batch=10)}})
    with consuming(app, SOURCE):
        assert wait_until(lambda: sqs_queue.counts(sqs_queue.dead_url)[0] == 4, 20)
        assert wait_until(lambda: sqs_queue.counts() == (0, 0), 10)
    dead = sqs_queue.receive_all(sqs_queue.dead_url)
    assert sorted(d["Body"] for d in dead) == sorted(e["MessageBody"] for e in big)
    assert dead_letter_count(app, SOURCE, "dedup-key-missing") == 4


@pytest.fixture
def small_dead_letter_queue(make_app, sqs_queue: SqsQueue, caplog) -> Any:
    """The source's app, its dead-letter queue taking 1,024 bytes at most (SQS's least).

    The brokers' WARNING lines are captured.
    """
    sqs_queue.client().set_queue_attributes(
        QueueUrl=sqs_queue.dead_url, Attributes={"MaximumMessageSize": "1024"}
    )
    app = make_app({"sources": {SOURCE: sqs_source(sqs_queue)}})
    caplog.set_level(logging.WARNING, "webhook_receiver.brokers")
    return app


def test_a_dead_letter_too_long_for_the_dead_letter_queue_is_deleted_without_a_copy(
    small_dead_letter_queue, sqs_queue: SqsQueue, caplog
):
    # The dead-letter queue takes 1,024 bytes at most (SQS's least): the
    # 2,000-byte poison message's copy is refused for good. It was retried
    # every 5 s for ever, with the small poison message sent in the same
    # call (SQS refuses the whole call for one entry), and neither reached it.
    small = _entry(None, json.dumps({"n": 1}).encode())
    large = _entry(None, json.dumps({"n": 2, "pad": "x" * 2000}).encode())
    sqs_queue.send([small, large, _entry("m-3", _body(3))])
    app = small_dead_letter_queue
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 20)
        assert wait_until(lambda: sqs_queue.counts() == (0, 0), 20)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "dedup-key-missing") == 2, 10)
    [copy] = sqs_queue.receive_all(sqs_queue.dead_url)
    assert copy["Body"] == small["MessageBody"]
    assert copy["MessageAttributes"]["dead-letter-reason"]["StringValue"] == "dedup-key-missing"
    refused = [r for r in caplog.records if "was refused (" in r.getMessage()]
    assert [r.levelno for r in refused] == [logging.ERROR]
    assert "Message must be shorter than 1024 bytes" in refused[0].getMessage()
    assert "the message is deleted without one" in refused[0].getMessage()
    assert rejections(app, SOURCE) == {"dedup-key-missing": 2}


class _CountingAttributes:
    """The consumer's SQS client, its sends sized as SQS sizes them (moto counts the body only).

    SQS counts each message attribute's name, type and value towards the
    queue's MaximumMessageSize, and refuses a longer message with moto's
    error; what fits is sent to moto.
    """

    def __init__(self, client: Any, limit: int) -> None:
        self._client, self._limit = client, limit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def send_message_batch(self, **call: Any) -> Any:
        import botocore.exceptions

        for entry in call["Entries"]:
            size = len(entry["MessageBody"].encode())
            for name, value in (entry.get("MessageAttributes") or {}).items():
                size += len(name) + len(value["DataType"]) + len(value["StringValue"])
            if size > self._limit:
                error = {
                    "Code": "InvalidParameterValue",
                    "Message": "One or more parameters are invalid. Reason: Message must be "
                    f"shorter than {self._limit} bytes.",
                }
                raise botocore.exceptions.ClientError({"Error": error}, "SendMessageBatch")
        return self._client.send_message_batch(**call)


def test_a_dead_letter_the_reason_attribute_makes_too_long_is_sent_without_it(
    small_dead_letter_queue, sqs_queue: SqsQueue, monkeypatch, caplog
):
    # Both queues take 1,024 bytes: a poison message of 1,000 bytes with
    # its type attribute fits; its copy, with the reason attribute, does not.
    from webhook_receiver.brokers.sqs import SqsConsumer

    made = SqsConsumer._client
    monkeypatch.setattr(SqsConsumer, "_client", lambda self: _CountingAttributes(made(self), 1024))
    near = _entry(None, json.dumps({"pad": "x" * 989}).encode())
    assert len(near["MessageBody"]) == 1000
    sqs_queue.send([near, _entry("m-1", _body(1))])
    app = small_dead_letter_queue
    with consuming(app, SOURCE):
        assert wait_until(lambda: sqs_queue.counts(sqs_queue.dead_url)[0] == 1, 20)
        assert wait_until(lambda: sqs_queue.counts() == (0, 0), 20)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "dedup-key-missing") == 1, 10)
    assert count_events(app) == 1
    [copy] = sqs_queue.receive_all(sqs_queue.dead_url)
    assert copy["Body"] == near["MessageBody"]
    assert copy["MessageAttributes"] == near["MessageAttributes"]  # unchanged, no reason
    assert "was refused with its dead-letter-reason attribute" in caplog.text
    assert "dedup-key-missing" in caplog.text
    assert "deleted without one" not in caplog.text


@pytest.mark.parametrize("attributes", ["its-own-reason", "ten-attributes"])
def test_a_dead_letter_with_no_room_for_the_reason_keeps_its_attributes_and_says_so(
    make_app, sqs_queue: SqsQueue, caplog, attributes
):
    # The copy is the message unchanged plus a reason attribute. A producer's
    # own dead-letter-reason (a message redriven from a dead-letter queue,
    # say) was overwritten with ours; a message with SQS's most of 10
    # attributes got none, silently. Either way the copy now carries the
    # message's attributes exactly, and a WARNING gives the reason, as
    # Pub/Sub's copies do.
    extra = (
        {"dead-letter-reason": "the producer's own"}
        if attributes == "its-own-reason"
        else {f"a{n}": str(n) for n in range(9)}
    )
    poison = _entry(None, _body(1), **extra)
    assert len(poison["MessageAttributes"]) <= 10
    sqs_queue.send([poison, _entry("m-2", _body(2))])
    app = make_app({"sources": {SOURCE: sqs_source(sqs_queue)}})
    caplog.set_level(logging.WARNING, "webhook_receiver.brokers")
    with consuming(app, SOURCE):
        assert wait_until(lambda: sqs_queue.counts(sqs_queue.dead_url)[0] == 1, 20)
        assert wait_until(lambda: sqs_queue.counts() == (0, 0), 20)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "dedup-key-missing") == 1, 10)
    [copy] = sqs_queue.receive_all(sqs_queue.dead_url)
    assert copy["Body"] == poison["MessageBody"]
    assert copy["MessageAttributes"] == poison["MessageAttributes"]
    [warning] = [
        r for r in caplog.records if "went without its dead-letter-reason" in r.getMessage()
    ]
    assert warning.levelno == logging.WARNING
    assert "dedup-key-missing" in warning.getMessage()
