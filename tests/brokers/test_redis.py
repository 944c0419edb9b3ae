"""The Redis Streams consumer against the real Redis: what the contract suite does not cover.

An entry's fields, id and stream kept with its event; the whole entry as the
body; a killed consumer's pending entries claimed (XAUTOCLAIM) by a second
one; an entry delivered more than ``max_deliveries`` times dead-lettered as
poison; entries held through a database outage kept from other consumers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import uuid

import pytest
from sqlalchemy import select

from webhook_receiver.brokers import runner
from webhook_receiver.config import ConfigError, ForwardConfig, parse
from webhook_receiver.config.forwards import parse_forwards
from webhook_receiver.extensions import db
from webhook_receiver.models import Event
from webhook_receiver.processing import publishers

from ..helpers.brokers import FORWARDED
from . import worked_examples
from .conftest import (
    consuming,
    count_events,
    dead_letter_count,
    duplicate_total,
    start_consume,
    stop,
    stored_keys,
    wait_until,
)
from .redis_fixtures import GROUP, RedisStream, redis_source
from .running import hold_writers, key_counts, log_tail, terminate, toml

SOURCE = "jobs"


def _entry(n: int, **extra: str | bytes) -> dict[str, str | bytes]:
    return {
        "message_id": f"job-{n}",
        "type": "job.created",
        "body": json.dumps({"job": n}).encode(),
        **extra,
    }


def _events(app) -> list[Event]:
    with app.app_context():
        events = list(db.session.execute(select(Event).order_by(Event.id)).scalars())
        db.session.expunge_all()
        db.session.rollback()
        return events


def test_an_entry_is_stored_with_its_fields_id_and_stream(make_app, redis_stream):
    app = make_app({"sources": {SOURCE: redis_source(redis_stream)}})
    redis_stream.publish([_entry(1, content_type="application/json", region="eu")])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        assert wait_until(lambda: redis_stream.unsettled() == 0, 10)
    [event] = _events(app)
    [(entry_id, _)] = redis_stream.client().xrange(redis_stream.name)
    assert (event.dedup_key, event.event_type, event.body) == (
        "job-1",
        "job.created",
        b'{"job": 1}',
    )
    assert event.content_type == "application/json"
    assert ["region", "eu"] in event.headers and ["message_id", "job-1"] in event.headers
    assert event.meta["stream"] == redis_stream.name and event.meta["group"] == GROUP
    assert event.meta["id"] == entry_id.decode()


def test_without_body_field_the_whole_entry_is_the_body_and_id_may_be_the_key(
    make_app, redis_stream
):
    table = redis_source(redis_stream, body_field="", dedup_key="id", event_type="json:/kind")
    app = make_app({"sources": {SOURCE: table}})
    redis_stream.publish([{"kind": "ping", "n": "1"}, {"kind": "ping", "n": b"\xff"}])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 2, 30)
    ids = [i.decode() for i, _ in redis_stream.client().xrange(redis_stream.name)]
    events = _events(app)
    assert [e.dedup_key for e in events] == ids
    assert json.loads(events[0].body) == {"kind": "ping", "n": "1"}
    # A value that is not UTF-8 is kept exactly, as base64.
    assert json.loads(events[1].body) == {"kind": "ping", "n": "base64:/w=="}
    assert {e.event_type for e in events} == {"ping"}


def test_a_killed_consumers_pending_entries_are_claimed_by_a_second_consumer(
    make_app, db_url, tmp_path, redis_stream
):
    table = redis_source(redis_stream, claim_idle_seconds=1)
    sources = {SOURCE: table}
    app = make_app({"sources": sources})
    process, log = start_consume(db_url, toml(sources), tmp_path)
    try:
        assert wait_until(lambda: "consuming" in log.read_text(), 30), log_tail(log)
        release = hold_writers(db_url)  # the first consumer reads, but cannot store
        try:
            redis_stream.publish([_entry(n) for n in range(40)])
            assert wait_until(lambda: redis_stream.group()["pending"] == 40, 30), log_tail(log)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        finally:
            release()
    finally:
        stop(process)
    [killed] = redis_stream.client().xinfo_consumers(redis_stream.name, GROUP)
    assert killed["pending"] == 40  # left pending with the dead consumer
    # Nothing was acked. On PostgreSQL the killed consumer's batch statement,
    # waiting on the lock, may still commit once it is released (the server
    # finishes a statement whose client died): stored, never acked, so its
    # entries come back below and are duplicates, each key still one event.
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 40, 30)
        assert wait_until(lambda: redis_stream.unsettled() == 0, 10)
    keys = key_counts(db_url)
    assert set(keys) == {f"job-{n}" for n in range(40)} and max(keys.values()) == 1
    consumers = {
        c["name"]: c["pending"]
        for c in redis_stream.client().xinfo_consumers(redis_stream.name, GROUP)
    }
    # The second consumer claimed them all, then left the group cleanly.
    assert consumers == {killed["name"]: 0}


def test_an_entry_delivered_more_than_max_deliveries_is_dead_lettered_as_poison(
    make_app, redis_stream
):
    redis_stream.publish([_entry(1), _entry(2)])
    client = redis_stream.client()
    # A consumer that read both and died; the first had failed four before it.
    client.xreadgroup(GROUP, "gone", {redis_stream.name: ">"})
    first, second = (i for i, _ in client.xrange(redis_stream.name))
    client.xclaim(redis_stream.name, GROUP, "gone", 0, [first], idle=5000, retrycount=5)
    client.xclaim(redis_stream.name, GROUP, "gone", 0, [second], idle=5000)
    table = redis_source(redis_stream, claim_idle_seconds=1, max_deliveries=5)
    app = make_app({"sources": {SOURCE: table}})
    with consuming(app, SOURCE):
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "max-deliveries") == 1, 30)
        assert wait_until(lambda: count_events(app) == 1, 10)
        assert wait_until(lambda: redis_stream.unsettled() == 0, 10)
    assert stored_keys(app) == ["job-2"]  # the second, delivered twice, is stored
    [dead] = redis_stream.dead_letters()
    # Its fields unchanged, with where it came from and why.
    assert {k: v for k, v in dead.items() if not k.startswith(b"dead_letter_")} == {
        k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in _entry(1).items()
    }
    assert dead[b"dead_letter_reason"] == b"max-deliveries"
    assert (dead[b"dead_letter_id"], dead[b"dead_letter_stream"]) == (
        first,
        redis_stream.name.encode(),
    )


def test_entries_held_through_a_database_stall_are_not_claimed_by_another_consumer(
    make_app, db_url, redis_stream
):
    # The first consumer holds its batch while the database stalls (then is
    # away), for longer than claim_idle_seconds; the second, claiming every
    # second, must not take it (the first resets its entries' idle time).
    table = redis_source(redis_stream, claim_idle_seconds=1)
    app = make_app({"sources": {SOURCE: table}})
    config = app.config["FILE_CONFIG"].brokers[SOURCE]
    holder_stop, other_stop = threading.Event(), threading.Event()
    holder = runner.consumer_for(app, config, holder_stop)
    release = hold_writers(db_url)
    holder_thread = threading.Thread(target=holder.run)
    holder_thread.start()
    try:
        redis_stream.publish([_entry(n) for n in range(10)])
        assert wait_until(lambda: redis_stream.group()["pending"] == 10, 30)
        other = runner.consumer_for(app, config, other_stop)
        other_thread = threading.Thread(target=other.run)
        other_thread.start()
        try:
            assert wait_until(lambda: len(_consumers(redis_stream)) == 2, 10)
            wait_until(lambda: False, 3.5)  # three claim passes of the second consumer
            pending = _consumers(redis_stream)
            assert pending[other.name] == 0 and pending[holder.name] == 10  # type: ignore[attr-defined]
        finally:
            release()
            assert wait_until(lambda: count_events(app) == 10, 60)
            other_stop.set()
            other_thread.join(30)
    finally:
        holder_stop.set()
        holder_thread.join(30)
    assert wait_until(lambda: redis_stream.unsettled() == 0, 10)
    assert sorted(stored_keys(app)) == sorted(f"job-{n}" for n in range(10))


def _consumers(stream: RedisStream) -> dict[str, int]:
    return {
        c["name"].decode(): c["pending"]
        for c in stream.client().xinfo_consumers(stream.name, GROUP)
    }


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        (
            {"dedup_key": "header:message_id"},
            "dedup_key: 'header:message_id' is not 'field:<name>'",
        ),
        ({"event_type": "id"}, "'id' (the entry id) is a dedup key"),
        ({"dedup_key": "field:body"}, "field 'body' is the body (body_field)"),
        ({"dead_letter_stream": "jobs"}, "dead_letter_stream must name a stream other than"),
        ({"url": "amqp://127.0.0.1"}, "url must be a redis:// or rediss:// or unix:// URL"),
        ({"claim_idle_seconds": 0}, "claim_idle_seconds must be a positive integer"),
        ({"max_deliveries": "5"}, "max_deliveries must be a positive integer"),
        ({"consumer": "me"}, "unknown key(s) for provider redis: consumer"),
    ],
)
def test_a_redis_source_that_cannot_work_is_refused_when_loaded(table, problem):
    base = {"provider": "redis", "url": "redis://127.0.0.1:6379/0", "stream": "jobs"}
    with pytest.raises(ConfigError) as refused:
        parse({"sources": {SOURCE: {**base, **table}}}, providers=())
    assert problem in str(refused.value)


def test_a_redis_source_s_defaults():
    table = {"provider": "redis", "url": "redis://h/0", "stream": "jobs"}
    source = parse({"sources": {SOURCE: table}}, providers=()).brokers[SOURCE]
    assert (source.dedup_key, source.event_type, source.group_id, source.body_field) == (
        "field:message_id",
        "",
        "webhook-receiver",
        "body",
    )
    assert (source.claim_idle_seconds, source.max_deliveries, source.batch) == (60, 5, 200)


def test_a_consume_process_stopped_cleanly_leaves_the_group(
    make_app, db_url, tmp_path, redis_stream
):
    # Its consumer name is its own (host, pid, tag): once nothing is pending
    # with it, SIGTERM removes it, and the group keeps no trace of the process.
    sources = {SOURCE: redis_source(redis_stream, claim_idle_seconds=1)}
    app = make_app({"sources": sources})
    redis_stream.publish([_entry(n) for n in range(20)])
    process, log = start_consume(db_url, toml(sources), tmp_path)
    try:
        assert wait_until(lambda: count_events(app) == 20, 30), log_tail(log)
    finally:
        code = terminate(process, log)
    assert code == 0, log_tail(log)
    assert redis_stream.client().xinfo_consumers(redis_stream.name, GROUP) == []


def test_the_docs_worked_example_runs_as_written(make_app, redis_url):
    name, table, commands = worked_examples.example("Redis Streams")
    stream = f"wr-test-{uuid.uuid4().hex[:10]}"
    swap = {
        f"'{table['dead_letter_stream']}'": f"'{stream}.dead'",
        f"'{table['stream']}'": f"'{stream}'",
    }
    table = {**table, "url": redis_url, "stream": stream, "dead_letter_stream": f"{stream}.dead"}
    app = make_app({"sources": {name: table}})
    try:
        for args, expected in commands:
            if args[0] == "consume":
                with consuming(app, name):
                    assert wait_until(lambda: count_events(app) == 1, 30)
            else:
                worked_examples.run(app, args, expected, swap)
        [event] = _events(app)
        assert (event.dedup_key, event.event_type, event.body) == (
            "job-1",
            "job.created",
            b'{"job": 1}',
        )
    finally:
        RedisStream(redis_url, stream).delete()


def _forward(url: str, stream: str) -> ForwardConfig:
    [forward] = parse_forwards([{"name": "bus", "url": url, "stream": stream}], "test")
    return forward


def test_a_forward_adds_an_entry_that_a_redis_source_reads_as_one_event(make_app, redis_stream):
    forward = _forward(redis_stream.url, redis_stream.name)
    publishers.publish(forward, FORWARDED)
    publishers.publish(forward, FORWARDED)  # a worker killed before marking it done
    entries = [fields for _, fields in redis_stream.client().xrange(redis_stream.name)]
    assert len(entries) == 2 and entries[0] == entries[1]
    assert entries[0][b"message_id"] == b"bus:stripe:evt_1"
    assert entries[0][b"X-Webhook-Event-Id"] == b"7"
    # A source with the defaults reads it back: one event, one duplicate.
    table = redis_source(redis_stream)
    del table["dedup_key"], table["event_type"]
    app = make_app({"sources": {SOURCE: {**table, "event_type": "field:type"}}})
    with consuming(app, SOURCE):
        assert wait_until(lambda: redis_stream.unsettled() == 0, 30)
        assert wait_until(lambda: duplicate_total(app) == 1, 10)
    [event] = _events(app)
    assert (event.dedup_key, event.event_type, event.body) == (
        "bus:stripe:evt_1",
        "invoice.paid",
        b'{"paid": true}',
    )
    assert (event.content_type, event.correlation_id) == ("application/json", "req-1")


def test_a_forward_to_a_redis_that_does_not_answer_is_a_retryable_failure():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    forward = _forward(f"redis://:secret@127.0.0.1:{port}/0", "jobs")
    with pytest.raises(publishers.PublishError) as failed:
        publishers.publish(forward, FORWARDED)
    assert "secret" not in str(failed.value)


def test_an_entry_deleted_while_pending_with_the_consumer_is_no_event(make_app, redis_stream):
    # The consumer read an entry and lost Redis before its XACK; meanwhile the
    # entry was deleted (XDEL, or trimmed). Read again from its own pending
    # entries (XREADGROUP from 0), it comes back with no fields: not an event
    # of the whole (empty) entry, nor a spurious conflict, but a dead letter
    # with nothing left to copy.
    table = redis_source(redis_stream, body_field="", dedup_key="id", event_type="json:/kind")
    app = make_app({"sources": {SOURCE: table}})
    stop_flag = threading.Event()
    consumer = runner.consumer_for(app, app.config["FILE_CONFIG"].brokers[SOURCE], stop_flag)
    redis_stream.publish([{"kind": "ping", "n": "1"}])
    client = redis_stream.client()
    [(gone, _)] = client.xrange(redis_stream.name)
    client.xreadgroup(GROUP, consumer.name, {redis_stream.name: ">"})  # type: ignore[attr-defined]
    client.xdel(redis_stream.name, gone)
    redis_stream.publish([{"kind": "ping", "n": "2"}])
    thread = threading.Thread(target=consumer.run)
    thread.start()
    try:
        assert wait_until(lambda: count_events(app) >= 1 and redis_stream.unsettled() == 0, 30)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "payload-invalid") == 1, 10)
    finally:
        stop_flag.set()
        thread.join(30)
    assert not thread.is_alive()
    [event] = _events(app)
    assert json.loads(event.body) == {"kind": "ping", "n": "2"}
    assert redis_stream.dead_letters() == []


def test_an_entry_whose_dead_letter_copy_fails_is_not_acknowledged_away(make_app, redis_stream):
    # dead_letter_stream names a key that is no stream: in the MULTI/EXEC the
    # copy's XADD fails alone (WRONGTYPE) and the XACK beside it went through,
    # the entry lost. It must stay pending, and be dead-lettered once the
    # stream can take it.
    client = redis_stream.client()
    client.set(redis_stream.dead, "not a stream")
    app = make_app({"sources": {SOURCE: redis_source(redis_stream, claim_idle_seconds=1)}})
    poison = {"type": "job.created", "body": b'{"no": "key"}'}
    redis_stream.publish([_entry(1), poison])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        wait_until(lambda: False, 2)
        assert redis_stream.group()["pending"] >= 1  # the poison entry, kept
        client.delete(redis_stream.dead)
        assert wait_until(lambda: len(redis_stream.dead_letters()) == 1, 30)
        assert wait_until(lambda: redis_stream.unsettled() == 0, 10)
    [dead] = redis_stream.dead_letters()
    assert dead[b"body"] == b'{"no": "key"}' and dead[b"dead_letter_reason"] == b"dedup-key-missing"
    assert stored_keys(app) == ["job-1"]
    assert duplicate_total(app) == 0  # the stored entry was acknowledged, not read again


@pytest.mark.parametrize("own", ["reason", "all-three"])
def test_a_dead_letter_keeps_the_entrys_own_dead_letter_fields_and_says_so(
    make_app, redis_stream, caplog, own
):
    # An entry redriven from a dead-letter stream carries our fields of its
    # own. The copy replaced them with ours. Redis keeps a repeated field
    # name, but redis-py (ours, and most readers') reads it as its last
    # value: ours beside theirs would hide theirs. The copy keeps the
    # entry's fields, adds only ours it has no field of, and a WARNING gives
    # our reason and the entry's id, as SQS's and Pub/Sub's copies do.
    theirs = {"dead_letter_reason": "the producer's own"}
    if own == "all-three":
        theirs |= {"dead_letter_id": "7-0", "dead_letter_stream": "elsewhere"}
    poison = {"type": "job.created", "body": b'{"no": "key"}', **theirs}
    redis_stream.publish([poison, _entry(1)])
    app = make_app({"sources": {SOURCE: redis_source(redis_stream)}})
    caplog.set_level("WARNING", "webhook_receiver.brokers")
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        assert wait_until(lambda: redis_stream.unsettled() == 0, 10)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "dedup-key-missing") == 1, 10)
    [(entry_id, _), _] = redis_stream.client().xrange(redis_stream.name)
    [dead] = redis_stream.dead_letters()
    sent = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in poison.items()}
    ours = {b"dead_letter_id": entry_id, b"dead_letter_stream": redis_stream.name.encode()}
    assert dead == (sent if own == "all-three" else {**sent, **ours})
    kept = (
        "dead_letter_reason, dead_letter_id and dead_letter_stream fields"
        if own == "all-three"
        else "dead_letter_reason field"
    )
    [warning] = [r for r in caplog.records if "went without its dead_letter_" in r.getMessage()]
    assert warning.levelname == "WARNING"
    message = warning.getMessage()
    assert f"went without its {kept} (" in message
    assert entry_id.decode() in message and "dedup-key-missing" in message
