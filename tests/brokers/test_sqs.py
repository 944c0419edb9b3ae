"""The SQS consumer beyond the contract suite: visibility, redrive, FIFO queues, what is stored.

Against moto's server (tests/sqs_server.py), on both databases. The
contract suite (test_contract.py) holds it to every broker's promises.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from sqlalchemy import select

from webhook_receiver import config as cfg
from webhook_receiver.extensions import db
from webhook_receiver.models import Event
from webhook_receiver.webhooks.providers import PROVIDERS

from .cloud_fixtures import SqsQueue, sqs_source
from .conftest import consuming, count_events, dead_letter_count, duplicate_total, wait_until
from .running import hold_writers

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
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
    with app.app_context():
        event = db.session.execute(select(Event)).scalar_one()
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


def _parse(**table: Any) -> Any:
    return cfg.parse({"sources": {"jobs": table}}, "receiver.toml", providers=PROVIDERS)


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
    with pytest.raises(cfg.ConfigError, match=r"\[sources\.jobs\]") as refused:
        _parse(provider="sqs", **table)
    assert problem in str(refused.value)


def test_the_issue_s_sqs_source_reads_its_region_from_the_url():
    source = _parse(
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
