"""The Kafka consumer against a real Kafka-compatible broker (Tansu), on both databases.

The broker contract (tests/brokers/test_contract.py) holds the Kafka adapter
to every promise the other brokers keep; these are Kafka's own: partitions
shared by a group of processes, offsets stored in the inbox's transaction
(a restart reads on from them, whatever Kafka's committed offsets say),
kill -9 through rebalances, dead letters with Kafka Connect's headers, and
what is stored of a record.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from sqlalchemy import select

from webhook_receiver import inbox
from webhook_receiver.extensions import db
from webhook_receiver.models import Event

from .conftest import (
    Topic,
    consuming,
    count_conflicts,
    count_events,
    dead_letter_count,
    duplicate_total,
    kafka_source,
    rejections,
    start_consume,
    stop,
    stored_keys,
    wait_until,
)
from .running import key_counts, log_tail, publish_in_background, terminate, toml

SOURCE = "orders"


def record(n: int, *, total: int | None = None, **headers: str) -> tuple[None, bytes, list]:
    """The n-th record: its key in the message-id header, type and content type in headers."""
    body = json.dumps({"n": n, "total": n if total is None else total}).encode()
    pairs = [("message-id", f"m-{n}".encode()), ("type", b"order.paid")]
    pairs += [(name, value.encode()) for name, value in headers.items()]
    return (None, body, pairs)


@pytest.fixture
def two_partitions(kafka_bootstrap: str) -> Topic:
    topic = Topic(kafka_bootstrap, f"wr-test-{uuid.uuid4().hex[:10]}", partitions=2)
    topic.create()
    return topic


def _positions(app: Any) -> dict[tuple[str, int], int]:
    with app.app_context():
        return inbox.stored_positions(SOURCE)


def _commit(topic: Topic, offsets: dict[int, int]) -> None:
    """Commit the group's offsets from outside (as an operator's reset would)."""
    consumer = Consumer(
        {"bootstrap.servers": topic.bootstrap, "group.id": topic.group, "log_level": 3}
    )
    try:
        consumer.commit(
            offsets=[TopicPartition(topic.name, p, o) for p, o in offsets.items()],
            asynchronous=False,
        )
    finally:
        consumer.close()


# -- one consumer in this process ------------------------------------------------------


def test_a_record_is_stored_with_its_value_key_headers_and_position(make_app, kafka_topic):
    app = make_app({"sources": {SOURCE: kafka_source(kafka_topic, dedup_key="key")}})
    value = b'{"id": 1, "amount": 9}'
    kafka_topic.publish(
        [
            (
                b"order-1",
                value,
                [
                    ("type", b"order.paid"),
                    ("content-type", b"application/json"),
                    ("Authorization", b"Bearer s3cret"),
                    ("raw", b"\xff\x00"),
                ],
            )
        ]
    )
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
    with app.app_context():
        event = db.session.execute(select(Event)).scalar_one()
        assert (event.dedup_key, event.event_type, event.body) == ("order-1", "order.paid", value)
        assert event.content_type == "application/json"
        headers = dict(event.headers)
        assert headers["Authorization"] != "Bearer s3cret"  # redacted
        assert headers["raw"] == "base64:/wA="  # bytes that are not UTF-8, kept exactly
        meta = event.meta
        assert (meta["broker"], meta["topic"], meta["partition"], meta["offset"]) == (
            "kafka",
            kafka_topic.name,
            0,
            0,
        )
        assert meta["timestamp"] > 1_700_000_000_000
        assert meta["properties"]["key"] == "order-1"
    assert _positions(app) == {(kafka_topic.name, 0): 1}
    assert wait_until(lambda: kafka_topic.lag() == 0, 10)  # committed to Kafka too, for lag tools


def test_offset_keys_see_redeliveries_only_and_topic_types(make_app, kafka_topic):
    table = kafka_source(kafka_topic, dedup_key="offset", event_type="topic", offsets="kafka")
    app = make_app({"sources": {SOURCE: table}})
    kafka_topic.publish([record(1), record(1)])  # a producer's retry: two offsets, two events
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 2 and kafka_topic.lag() == 0, 30)
    _commit(kafka_topic, {0: 0})  # Kafka's offsets reset: every record comes back
    with consuming(app, SOURCE):
        assert wait_until(lambda: duplicate_total(app) == 2 and kafka_topic.lag() == 0, 30)
    name = kafka_topic.name
    assert sorted(stored_keys(app)) == [f"{name}/0/0", f"{name}/0/1"]
    with app.app_context():
        assert set(db.session.execute(select(Event.event_type)).scalars()) == {name}


def test_json_keys(make_app, kafka_topic):
    app = make_app({"sources": {SOURCE: kafka_source(kafka_topic, dedup_key="json:/n")}})
    kafka_topic.publish([record(7), record(8), record(7)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 2 and duplicate_total(app) == 1, 30)
    assert sorted(stored_keys(app)) == ["7", "8"]


def test_a_restart_reads_on_from_the_inbox_not_from_kafkas_offsets(make_app, kafka_topic):
    app = make_app({"sources": {SOURCE: kafka_source(kafka_topic, batch=20)}})
    kafka_topic.publish([record(n) for n in range(100)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 100 and kafka_topic.lag() == 0, 30)
    assert _positions(app) == {(kafka_topic.name, 0): 100}
    # Kafka's committed offsets moved back (lost, reset, or behind the inbox's
    # after a crash): the consumer seeks to the inbox's and re-reads nothing.
    _commit(kafka_topic, {0: 0})
    kafka_topic.publish([record(n) for n in range(100, 110)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 110 and kafka_topic.lag() == 0, 30)
        time.sleep(0.5)
    assert duplicate_total(app) == 0
    assert _positions(app) == {(kafka_topic.name, 0): 110}


def test_with_no_stored_offset_the_group_s_committed_offset_is_read_on_from(make_app, kafka_topic):
    # A group that another consumer read before (no offset in the inbox yet):
    # the consumer starts at the group's committed offset, not the earliest.
    kafka_topic.publish([record(n) for n in range(50)])
    _commit(kafka_topic, {0: 30})
    app = make_app({"sources": {SOURCE: kafka_source(kafka_topic, batch=20)}})
    with consuming(app, SOURCE):
        assert wait_until(lambda: kafka_topic.lag() == 0 and count_events(app) >= 20, 30)
        time.sleep(0.5)
    assert sorted(stored_keys(app)) == sorted(f"m-{n}" for n in range(30, 50))
    assert _positions(app) == {(kafka_topic.name, 0): 50}


def test_kafkas_offset_behind_the_inbox_is_brought_level_with_nothing_left_to_read(
    make_app, kafka_topic
):
    app = make_app({"sources": {SOURCE: kafka_source(kafka_topic, batch=20)}})
    kafka_topic.publish([record(n) for n in range(100)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 100 and kafka_topic.lag() == 0, 30)
    # A consumer killed after its commit, before its asynchronous commit to
    # Kafka: the group's offset lags the inbox's, and no record is left to
    # read that would carry the next commit.
    _commit(kafka_topic, {0: 40})
    assert kafka_topic.lag() == 60
    with consuming(app, SOURCE):
        assert wait_until(lambda: kafka_topic.lag() == 0, 30)
    assert count_events(app) == 100 and duplicate_total(app) == 0


def test_offsets_in_kafka_come_back_as_duplicates_after_a_reset(make_app, kafka_topic):
    app = make_app({"sources": {SOURCE: kafka_source(kafka_topic, offsets="kafka")}})
    kafka_topic.publish([record(n) for n in range(50)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 50 and kafka_topic.lag() == 0, 30)
    assert _positions(app) == {}  # nothing kept in the inbox
    _commit(kafka_topic, {0: 20})
    with consuming(app, SOURCE):
        assert wait_until(lambda: duplicate_total(app) == 30 and kafka_topic.lag() == 0, 30)
    assert count_events(app) == 50


def test_a_conflict_and_a_poison_record_reach_the_dead_letter_topic_unchanged(
    make_app, kafka_topic
):
    app = make_app({"sources": {SOURCE: kafka_source(kafka_topic)}})
    original = record(1)
    conflicting = (b"k-1", json.dumps({"n": 1, "total": 999}).encode(), original[2])
    keyless = (b"k-2", b'{"n": 2}', [("type", b"order.paid"), ("trace", b"t-2")])
    kafka_topic.publish([original, conflicting, keyless, record(3)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 2 and kafka_topic.lag() == 0, 30)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "conflict") == 1, 10)
    assert dead_letter_count(app, SOURCE, "dedup-key-missing") == 1
    assert count_conflicts(app) == 1
    dead = kafka_topic.read_all(kafka_topic.dead)
    assert len(dead) == 2
    by_key = {m.key(): m for m in dead}
    for sent, offset, reason in ((conflicting, 1, "conflict"), (keyless, 2, "dedup-key-missing")):
        copy = by_key[sent[0]]
        assert copy.value() == sent[1]
        headers = copy.headers()
        assert headers[: len(sent[2])] == sent[2]  # the original headers, in order, first
        extra = dict(headers[len(sent[2]) :])
        assert extra["__connect.errors.topic"] == kafka_topic.name.encode()
        assert extra["__connect.errors.partition"] == b"0"
        assert extra["__connect.errors.offset"] == str(offset).encode()
        assert extra["__connect.errors.exception.class.name"] == reason.encode()
        assert extra["__connect.errors.exception.message"].startswith(reason.encode())
    # Their offsets moved on: the inbox reads on after the last record.
    assert _positions(app) == {(kafka_topic.name, 0): 4}


def test_without_a_dead_letter_topic_poison_is_counted_listed_and_passed(make_app, kafka_topic):
    table = kafka_source(kafka_topic)
    del table["dead_letter_topic"]
    app = make_app({"sources": {SOURCE: table}})
    kafka_topic.publish([(None, b'{"n": 0}', []), record(1)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1 and kafka_topic.lag() == 0, 30)
    assert dead_letter_count(app, SOURCE, "dedup-key-missing") == 1
    assert _positions(app) == {(kafka_topic.name, 0): 2}  # its offset moved on
    assert wait_until(lambda: rejections(app, SOURCE) == {"dedup-key-missing": 1}, 10)
    assert kafka_topic.read_all(kafka_topic.dead, quiet=0.5) == []


def test_a_missing_topic_is_waited_for(make_app, kafka_bootstrap, caplog):
    topic = Topic(kafka_bootstrap, f"wr-test-{uuid.uuid4().hex[:10]}")
    app = make_app({"sources": {SOURCE: kafka_source(topic)}})
    caplog.set_level("INFO", "webhook_receiver.brokers")
    with consuming(app, SOURCE):
        assert wait_until(lambda: "does not exist" in caplog.text, 20)
        topic.create()
        topic.publish([record(1)])
        assert wait_until(lambda: count_events(app) == 1, 60)
    assert caplog.text.count("does not exist") >= 1
    assert "topic back after" in caplog.text


# -- consumer processes ------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_share_two_partitions_each_record_stored_once(
    make_app, db_url, tmp_path, two_partitions
):
    topic = two_partitions
    sources = {SOURCE: kafka_source(topic, batch=200)}
    app = make_app({"sources": sources})
    unique = [record(n) for n in range(5000)]
    again = random.Random(30).sample(unique, 1500)  # 30 % produced twice
    stream = unique + again
    random.Random(31).shuffle(stream)
    processes = [start_consume(db_url, toml(sources), tmp_path) for _ in range(2)]
    try:
        assert wait_until(lambda: all("assigned" in log.read_text() for _, log in processes), 60)
        publish_in_background(topic.publish, stream, chunk=500).join()
        assert wait_until(lambda: count_events(app) == 5000 and topic.lag() == 0, 90), log_tail(
            processes[0][1]
        )
        assert wait_until(lambda: duplicate_total(app) == 1500, 30)
        # Both worked: each holds one partition.
        assert _positions(app).keys() == {(topic.name, 0), (topic.name, 1)}
    finally:
        codes = [terminate(process, log) for process, log in processes]
    assert codes == [0, 0]
    keys = key_counts(db_url)
    assert len(keys) == 5000 and max(keys.values()) == 1
    assert duplicate_total(app) == 1500  # exactly the producer's duplicates


def _paced(topic: Topic, records: list, chunk: int, every: float) -> threading.Thread:
    """Publish ``records`` from a thread, ``chunk`` of them every ``every`` seconds."""

    def go() -> None:
        for i in range(0, len(records), chunk):
            topic.publish(records[i : i + chunk])
            time.sleep(every)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def _holds_a_partition(log: Any) -> bool:
    """Whether a consumer's log says it was given a partition ("assigned nothing" is not)."""
    return re.search(r"assigned [^\s,]+\[\d+\]", log.read_text()) is not None


@pytest.mark.slow
@pytest.mark.parametrize("offsets", ["inbox", "kafka"])
def test_kill9_three_times_through_rebalances_loses_and_doubles_nothing(
    make_app, db_url, tmp_path, two_partitions, offsets
):
    topic = two_partitions
    sources = {SOURCE: kafka_source(topic, batch=100, offsets=offsets)}
    app = make_app({"sources": sources})
    config = toml(sources)
    steady = start_consume(db_url, config, tmp_path)
    victim = start_consume(db_url, config, tmp_path)
    total = 3000 if offsets == "inbox" else 1200  # Kafka's: one round
    # Paced, so that the stream outlasts the three rounds (each waits out a session).
    publisher = _paced(topic, [record(n) for n in range(total)], chunk=50, every=1.0)
    try:
        # Kafka's offsets: once is enough to see what comes back counted as duplicates.
        for round_ in range(1, 4 if offsets == "inbox" else 2):
            # Killed once it holds a partition: its rebalance done, as Tansu
            # needs (a member killed mid-join stays its group's leader there,
            # and no other member syncs again: docs/brokers.md).
            log = victim[1]
            assert wait_until(lambda log=log: _holds_a_partition(log), 60), (round_, log_tail(log))
            stored = count_events(app)
            assert wait_until(lambda s=stored: count_events(app) >= s + 100, 60), log_tail(
                victim[1]
            )
            os.killpg(victim[0].pid, signal.SIGKILL)  # mid-stream, mid-batch
            victim[0].wait(10)
            # A new member joins: the group rebalances once the dead one's session ends.
            victim = start_consume(db_url, config, tmp_path)
        log = victim[1]
        assert wait_until(lambda log=log: _holds_a_partition(log), 60), log_tail(log)
        publisher.join()
        assert wait_until(lambda: count_events(app) == total and topic.lag() == 0, 90), log_tail(
            steady[1]
        )
    finally:
        stop(victim[0])
        code = terminate(*steady)
    assert code == 0, log_tail(steady[1])
    keys = key_counts(db_url)
    assert set(keys) == {f"m-{n}" for n in range(total)} and max(keys.values()) == 1
    time.sleep(1)  # the last batches' redelivery counts
    if offsets == "inbox":
        # Nothing stored was read again: no duplicate the producer did not send.
        assert duplicate_total(app) == 0


def test_a_poison_record_too_large_to_copy_does_not_stop_the_consumer(make_app, kafka_topic):
    # A record the broker took, larger than the dead-letter producer may send
    # (librdkafka's message.max.bytes, 1,000,000): its copy is refused at once.
    from confluent_kafka import Producer

    app = make_app({"sources": {SOURCE: kafka_source(kafka_topic)}})
    big = Producer({"bootstrap.servers": kafka_topic.bootstrap, "message.max.bytes": 3_000_000})
    big.produce(kafka_topic.name, value=b"x" * 1_100_000, headers=[("type", b"order.paid")])
    assert big.flush(30) == 0
    kafka_topic.publish([record(1)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1 and kafka_topic.lag() == 0, 30)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "dedup-key-missing") == 1, 10)
    assert _positions(app) == {(kafka_topic.name, 0): 2}  # its offset moved on


@pytest.mark.parametrize("way_out", ["topic-missing", "consume-error"])
def test_a_session_s_consumer_is_closed_however_the_session_ends(
    make_app, kafka_bootstrap, monkeypatch, way_out
):
    # A session that ends on an error must close its consumer all the same:
    # left open, it stays in the group (its partitions wait for its session
    # to expire) and keeps librdkafka's threads, one more each back-off.
    from confluent_kafka import KafkaError, KafkaException

    from webhook_receiver.brokers import kafka as adapter

    made: list[Any] = []

    class Recorded(adapter.Consumer):  # type: ignore[misc]
        def __init__(self, settings: dict[str, Any]) -> None:
            super().__init__(settings)
            self.closed = False
            self.failed = way_out != "consume-error" or bool(made)
            made.append(self)

        def consume(self, *args: Any, **kwargs: Any) -> Any:
            if not self.failed:
                # The first session fails once it is in the group (its
                # partition assigned). Failing while its JoinGroup is still
                # in flight leaves Tansu a dead group leader that its
                # session's expiry never removes (docs/brokers.md): the
                # next member could then never sync.
                records = super().consume(*args, **kwargs)
                if not self.assignment():
                    return records
                self.failed = True
                raise KafkaException(KafkaError(KafkaError._TRANSPORT))
            return super().consume(*args, **kwargs)

        def close(self) -> None:
            self.closed = True
            super().close()

    monkeypatch.setattr(adapter, "Consumer", Recorded)
    topic = Topic(kafka_bootstrap, f"wr-test-{uuid.uuid4().hex[:10]}")
    if way_out == "consume-error":
        topic.create()
        topic.publish([record(1)])
    app = make_app({"sources": {SOURCE: kafka_source(topic)}})
    with consuming(app, SOURCE):
        # A second session has started: the first one has ended.
        assert wait_until(lambda: len(made) >= 2, 30)
        if way_out == "consume-error":
            assert wait_until(lambda: count_events(app) == 1, 30)
        assert made[0].closed
    assert all(consumer.closed for consumer in made)


def test_a_dead_letter_not_yet_reported_is_not_taken_as_delivered(
    make_app, kafka_topic, monkeypatch
):
    # The dead-letter topic's broker unreachable: the copy's delivery report
    # does not come. The record's offset must not move on as if the copy
    # were out; it is waited for until the consumer stops, then reported
    # undelivered (its offset stays, the record is read again).
    from webhook_receiver.brokers import batch
    from webhook_receiver.brokers import kafka as adapter

    from .conftest import free_port

    monkeypatch.setattr(adapter, "DEAD_LETTER_WAIT_SECONDS", 0.2)
    kafka_topic.publish([(b"k-1", b'{"n": 1}', [("trace", b"t-1")])])
    (taken,) = kafka_topic.read_all(kafka_topic.name)
    table = kafka_source(kafka_topic, bootstrap_servers=f"127.0.0.1:{free_port()}")
    app = make_app({"sources": {SOURCE: table}})
    stop_flag = threading.Event()
    consumer = adapter.KafkaConsumer(app, app.config["FILE_CONFIG"].brokers[SOURCE], stop_flag)
    verdict = batch.Verdict(batch.DEAD_LETTER, "dedup-key-missing", "no message-id header")
    result: list[list[Any]] = []
    worker = threading.Thread(
        target=lambda: result.append(consumer._dead_letter([(taken, verdict)])), daemon=True
    )
    worker.start()
    try:
        worker.join(2)
        assert result == [], "a copy with no delivery report was taken as delivered"
    finally:
        stop_flag.set()
        worker.join(10)
        if consumer._producer is not None:
            consumer._producer.purge()
            consumer._producer.flush(0)
    assert [(m.topic(), m.offset()) for m in result[0]] == [(kafka_topic.name, 0)]
