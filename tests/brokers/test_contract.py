"""The broker contract: every broker adapter, against its real server, on both databases.

One suite, parametrised over ``contract.BROKERS``: each message stored once
with its redeliveries counted; acknowledged only after the commit; a
conflict kept and dead-lettered unchanged; keyless and malformed messages
dead-lettered with their reason; kill -9 mid-stream loses and doubles
nothing (nor any duplicate count); SIGTERM finishes the batch in hand; the
database away settles nothing. A new broker runs all of it by adding one
entry there.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import time

import pytest

from .conftest import (
    consuming,
    count_conflicts,
    count_events,
    dead_letter_count,
    duplicate_total,
    start_consume,
    stop,
    stored_keys,
    wait_until,
)
from .contract import BROKERS, BrokerUnderTest, Message, broker_under_test, numbered
from .running import (
    count_rows,
    hold_writers,
    key_counts,
    log_tail,
    publish_in_background,
    terminate,
    toml,
)

SOURCE = "feed"


@pytest.fixture(params=[name for name, _, _ in BROKERS])
def broker(request: pytest.FixtureRequest) -> BrokerUnderTest:
    return broker_under_test(request)


def _app(make_app, broker: BrokerUnderTest, batch: int = 100, **extra):
    return make_app({"sources": {SOURCE: broker.source(batch, **extra)}})


def test_each_message_stored_once_and_its_redeliveries_counted(make_app, broker):
    app = _app(make_app, broker)
    messages = [numbered(n) for n in range(1000)]
    stream = messages + random.Random(11).sample(messages, 300)
    random.Random(12).shuffle(stream)
    broker.publish(stream)
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1000 and broker.drained(), 60)
        assert wait_until(lambda: duplicate_total(app) == 300, 30)
    assert sorted(stored_keys(app)) == sorted(m.key for m in messages)
    assert broker.drained()
    assert broker.dead_letters() == []


def test_a_conflict_is_kept_for_review_and_dead_lettered_unchanged(make_app, broker):
    app = _app(make_app, broker)
    broker.publish([numbered(1)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        other = numbered(1, total=999)
        broker.publish([other])
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "conflict") == 1, 30)
        assert wait_until(broker.drained, 10)
    assert (count_events(app), count_conflicts(app), duplicate_total(app)) == (1, 1, 0)
    [dead] = broker.dead_letters()
    assert (dead.key, dead.body) == ("m-1", other.body)
    assert dead.reason in ("conflict", None)  # None: the broker keeps no reason (logged)


def test_keyless_and_malformed_messages_are_dead_lettered_with_their_reason(make_app, broker):
    app = _app(make_app, broker)
    broker.publish([Message(None, b'{"n": 0}'), numbered(1)])
    broker.publish_malformed()
    broker.publish([numbered(2)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 2, 30)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "dedup-key-missing") == 1, 30)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "message-malformed") == 1, 30)
        assert wait_until(broker.drained, 10)
    assert sorted(stored_keys(app)) == ["m-1", "m-2"]
    dead = broker.dead_letters()
    assert sorted(d.body for d in dead) == [b'{"n": -1}', b'{"n": 0}']
    assert {d.reason for d in dead} <= {"dedup-key-missing", "message-malformed", None}


@pytest.mark.slow
def test_kill9_mid_stream_then_restart_stores_every_message_once(
    make_app, db_url, tmp_path, broker
):
    broker.expect_consumer_kill()
    sources = {SOURCE: broker.source(100)}
    app = make_app({"sources": sources})
    publisher = publish_in_background(broker.publish, [numbered(n) for n in range(2000)])
    process, log = start_consume(db_url, toml(sources), tmp_path)
    try:
        assert wait_until(lambda: count_events(app) >= 300, 60), log_tail(log)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    finally:
        stop(process)
    publisher.join()
    process, log = start_consume(db_url, toml(sources), tmp_path)
    try:
        assert wait_until(lambda: count_events(app) == 2000 and broker.drained(), 90), log_tail(log)
    finally:
        code = terminate(process, log)
    assert code == 0, log_tail(log)
    keys = key_counts(db_url)
    assert set(keys) == {f"m-{n}" for n in range(2000)} and max(keys.values()) == 1


# 300 of 700 messages, sent a second time.
AGAIN = [*range(0, 700, 7), *range(3, 700, 7), *range(5, 700, 7)]


@pytest.mark.slow
def test_kill9_after_a_stream_with_duplicates_loses_none_of_their_counts(
    make_app, db_url, tmp_path, broker
):
    # Once all are acknowledged the consumer is killed outright. Its
    # redeliveries' counts were written before their acks: all 300 are
    # there (the ledger's interval is set long, so a count still waiting in
    # it would be lost).
    sources = {SOURCE: broker.source(100)}
    broker.publish([numbered(n) for n in range(700)] + [numbered(n) for n in AGAIN])
    app = make_app({"sources": sources})
    process, log = start_consume(
        db_url, toml(sources), tmp_path, env={"WEBHOOK_RECEIVER_DUPLICATE_FLUSH_SECONDS": "60"}
    )
    try:
        assert wait_until(lambda: count_events(app) == 700 and broker.drained(), 60), log_tail(log)
        time.sleep(1)  # the last batch's acks (a RabbitMQ queue counts its ready messages only)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    finally:
        stop(process)
    assert broker.drained()  # every message was acknowledged: none comes back to be counted
    assert duplicate_total(app) == 300, log_tail(log)


@pytest.mark.slow
def test_sigterm_mid_batch_commits_and_acks_then_exits_0(make_app, db_url, tmp_path, broker):
    sources = {SOURCE: broker.source(500)}
    app = make_app({"sources": sources})
    process, log = start_consume(db_url, toml(sources), tmp_path)
    try:
        assert wait_until(lambda: "consuming" in log.read_text(), 30), log_tail(log)
        release = hold_writers(db_url)
        try:
            broker.publish([numbered(n) for n in range(300)])
            assert wait_until(lambda: broker.taken() > 0, 30), log_tail(log)
            time.sleep(0.3)  # the batch is in its transaction, waiting for the database
            process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert process.poll() is None  # it does not walk away from its batch
        finally:
            release()
        code = process.wait(timeout=30)
    finally:
        stop(process)
    assert code == 0, log_tail(log)
    stored = count_events(app)
    assert stored > 0, log_tail(log)  # the batch in hand was committed
    # Everything else is still the broker's: nothing acked that is not stored.
    assert stored + broker.left_after_stop() == 300


@pytest.mark.slow
def test_postgresql_stopped_mid_stream_nothing_acked_until_committed(
    stoppable_postgres, tmp_path, broker
):
    pg = stoppable_postgres
    sources = {SOURCE: broker.source(50)}
    process, log = start_consume(pg.url, toml(sources), tmp_path)
    try:
        broker.publish([numbered(n) for n in range(500)])
        assert wait_until(lambda: count_rows(pg.url) == 500 and broker.drained(), 60), log_tail(log)
        pg.stop("immediate")
        broker.publish([numbered(n) for n in range(500, 1000)])
        assert wait_until(lambda: "database unavailable" in log.read_text(), 30), log_tail(log)
        time.sleep(2)
        assert process.poll() is None  # a transient error never ends the consumer
        assert broker.unsettled() >= 500  # nothing acked that was not committed
        pg.start()
        assert wait_until(lambda: count_rows(pg.url) == 1000 and broker.drained(), 90), log_tail(
            log
        )
    finally:
        code = terminate(process, log)
    assert code == 0
    assert log.read_text().count("database unavailable") == 1  # one line when it began
    keys = key_counts(pg.url)
    assert set(keys) == {f"m-{n}" for n in range(1000)} and max(keys.values()) == 1


@pytest.mark.slow
def test_sqlite_write_locked_mid_stream_nothing_acked_until_committed(
    _sqlite_template, tmp_path, broker
):
    path = tmp_path / "locked.sqlite3"
    shutil.copyfile(_sqlite_template, path)
    url = f"sqlite:///{path}"
    sources = {SOURCE: broker.source(50)}
    process, log = start_consume(url, toml(sources), tmp_path)
    try:
        broker.publish([numbered(n) for n in range(500)])
        assert wait_until(lambda: count_rows(url) == 500 and broker.drained(), 60), log_tail(log)
        # Another process (a backup, a migration, a stuck script) holds the write lock.
        holder = sqlite3.connect(path, isolation_level=None, timeout=30)
        holder.execute("BEGIN IMMEDIATE")
        try:
            broker.publish([numbered(n) for n in range(500, 1000)])
            assert wait_until(lambda: "database unavailable" in log.read_text(), 30), log_tail(log)
            time.sleep(2)
            assert process.poll() is None
            assert count_rows(url) == 500  # readers go on in WAL mode: nothing committed
            assert broker.unsettled() >= 500  # and nothing acked
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert wait_until(lambda: count_rows(url) == 1000 and broker.drained(), 90), log_tail(log)
    finally:
        code = terminate(process, log)
    assert code == 0
    keys = key_counts(url)
    assert set(keys) == {f"m-{n}" for n in range(1000)} and max(keys.values()) == 1


@pytest.mark.slow
def test_a_stalled_database_is_said_once_and_nothing_is_settled_meanwhile(
    make_app, db_url, tmp_path, broker
):
    sources = {SOURCE: broker.source(50)}
    app = make_app({"sources": sources})
    env = {"WEBHOOK_RECEIVER_DATABASE_STALL_WARNING_SECONDS": "0.5"}
    process, log = start_consume(db_url, toml(sources), tmp_path, env=env)
    try:
        assert wait_until(lambda: "consuming" in log.read_text(), 30), log_tail(log)
        release = hold_writers(db_url)  # the batch's write waits, neither failing nor done
        try:
            broker.publish([numbered(n) for n in range(50)])
            assert wait_until(lambda: "database stalled" in log.read_text(), 30), log_tail(log)
            time.sleep(1)
            assert count_events(app) == 0
            assert broker.unsettled() >= 50  # nothing acked while the store waits
        finally:
            release()
        assert wait_until(lambda: count_events(app) == 50 and broker.drained(), 30), log_tail(log)
    finally:
        code = terminate(process, log)
    assert code == 0, log_tail(log)
    text = log.read_text()
    assert text.count("database stalled") == 1, log_tail(log)  # said once, not per second
    assert "database call finished after stalling" in text
