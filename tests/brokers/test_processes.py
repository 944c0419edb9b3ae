"""Real ``flask --app wsgi consume`` processes: competing consumers, kill -9, SIGTERM, outages."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from sqlalchemy import create_engine, text

from webhook_receiver.models import Event

from .conftest import (
    count_events,
    duplicate_total,
    nats_source,
    rabbit_source,
    start_consume,
    stop,
    stored_keys,
    wait_until,
)

pytestmark = pytest.mark.slow


def toml(sources: dict[str, dict[str, Any]]) -> str:
    """A config file holding these source tables (string and integer values)."""
    lines = []
    for name, table in sources.items():
        lines.append(f"[sources.{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def amqp_message(n: int) -> tuple[bytes, dict[str, Any]]:
    body = json.dumps({"order": n}).encode()
    return body, {"message_id": f"m-{n}", "type": "order", "content_type": "application/json"}


def nats_message(n: int) -> tuple[str, bytes, dict[str, str]]:
    return "paid", json.dumps({"payment": n}).encode(), {"Nats-Msg-Id": f"p-{n}"}


def _terminate(process: subprocess.Popen[bytes], log_path: Any) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        stop(process)
        raise AssertionError(f"consume did not stop on SIGTERM:\n{_log(log_path)}") from None


def _log(log_path: Any) -> str:
    return log_path.read_text(errors="replace")[-4000:]


def _keys_once(app: Any, expected: int, prefix: str) -> None:
    counts = Counter(stored_keys(app))
    assert len(counts) == expected
    assert max(counts.values()) == 1
    assert set(counts) == {f"{prefix}{n}" for n in range(expected)}


# The 300 of 1,000 messages the competing-consumer tests publish twice.
TWICE = [*range(0, 1000, 10), *range(3, 1000, 10), *range(7, 1000, 10)]


@contextmanager
def _two_consumers(
    db_url: str, config: str, tmp_path: Any, started: str
) -> Iterator[list[tuple[subprocess.Popen[bytes], Any]]]:
    """Two ``consume`` processes that logged ``started``; after the block, SIGTERM and exit 0."""
    consumers = [start_consume(db_url, config, tmp_path) for _ in range(2)]
    try:
        # Both consuming before the first message: else one may take them all
        # while the other still starts (and dies of the SIGTERM at the end,
        # before its handler is in place).
        for _, log in consumers:
            assert wait_until(lambda log=log: started in log.read_text(), 30), _log(log)
        yield consumers
    finally:
        codes = [_terminate(process, log) for process, log in consumers]
    assert codes == [0, 0], [_log(log) for _, log in consumers]


def test_two_consumer_processes_thousand_messages_thirty_percent_twice(
    make_app, db_url, tmp_path, amqp_queue
):
    sources = {"orders": rabbit_source(amqp_queue, prefetch=50)}
    app = make_app({"sources": sources})
    config = toml(sources)
    with _two_consumers(db_url, config, tmp_path, "consuming queue") as consumers:
        # The first copies from one publisher, the second copies from another at
        # the same time: the two consumers get the copies of a message concurrently.
        first = threading.Thread(
            target=amqp_queue.publish, args=([amqp_message(n) for n in range(1000)],)
        )
        second = threading.Thread(
            target=amqp_queue.publish, args=([amqp_message(n) for n in TWICE],)
        )
        first.start()
        second.start()
        first.join()
        second.join()
        assert wait_until(lambda: count_events(app) == 1000 and amqp_queue.ready() == 0, 90), [
            _log(log) for _, log in consumers
        ]
    _keys_once(app, 1000, "m-")
    # Each process writes its redeliveries' counts as it exits at the latest.
    assert duplicate_total(app) == 300
    # Unacknowledged messages would be back in the queue now that both are gone.
    assert amqp_queue.ready() == 0
    assert amqp_queue.ready(amqp_queue.dead) == 0


def test_two_consumer_processes_share_a_jetstream_durable_thirty_percent_twice(
    make_app, db_url, tmp_path, jetstream
):
    # Keyed by the body: JetStream's duplicate window would drop republishes
    # under the same Nats-Msg-Id before they reached either process.
    sources = {"payments": nats_source(jetstream, batch=50, dedup_key="json:/payment")}
    app = make_app({"sources": sources})
    config = toml(sources)
    # Both start at once, and both create the absent durable: one creates it,
    # the other finds it, and they pull from it as competing consumers.
    with _two_consumers(db_url, config, tmp_path, "consuming stream") as consumers:
        again = [
            (s, b, {"Nats-Msg-Id": h["Nats-Msg-Id"] + "-again"})
            for s, b, h in map(nats_message, TWICE)
        ]
        first = _publish_in_background(jetstream.publish, [nats_message(n) for n in range(1000)])
        second = _publish_in_background(jetstream.publish, again)
        first.join()
        second.join()
        assert wait_until(
            lambda: count_events(app) == 1000 and jetstream.pending() == (0, 0), 90
        ), [_log(log) for _, log in consumers]
    _keys_once(app, 1000, "")
    assert duplicate_total(app) == 300
    assert jetstream.pending() == (0, 0)
    # Both took part: each stored some of the events (a line per batch at INFO).
    assert all("batch stored" in log.read_text() for _, log in consumers)


def _publish_in_background(publish: Any, messages: list[Any], chunk: int = 50) -> threading.Thread:
    def go() -> None:
        for i in range(0, len(messages), chunk):
            publish(messages[i : i + chunk])

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def _short_ack_wait(stream: Any) -> None:
    # Created before the consumer process starts (it uses an existing durable):
    # a killed consumer's messages come back after 2 s rather than 30.
    async def go(nc: Any) -> None:
        config = ConsumerConfig(
            durable_name="webhook-receiver", ack_policy=AckPolicy.EXPLICIT, ack_wait=2
        )
        await nc.jetstream().add_consumer(stream.name, config)

    stream.run(go)


@pytest.mark.parametrize("broker", ["rabbitmq", "nats"])
def test_kill9_mid_stream_then_restart_stores_every_message_once(
    make_app, db_url, tmp_path, broker, request
):
    if broker == "rabbitmq":
        queue = request.getfixturevalue("amqp_queue")
        sources = {"feed": rabbit_source(queue, prefetch=100)}
        publish, messages, prefix = queue.publish, [amqp_message(n) for n in range(2000)], "m-"

        def drained() -> bool:
            return queue.ready() == 0
    else:
        stream = request.getfixturevalue("jetstream")
        _short_ack_wait(stream)
        sources = {"feed": nats_source(stream, batch=100)}
        publish, messages, prefix = stream.publish, [nats_message(n) for n in range(2000)], "p-"

        def drained() -> bool:
            return stream.pending() == (0, 0)

    app = make_app({"sources": sources})
    config = toml(sources)
    publisher = _publish_in_background(publish, messages)
    process, log = start_consume(db_url, config, tmp_path)
    try:
        assert wait_until(lambda: count_events(app) >= 300, 60), _log(log)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    finally:
        stop(process)
    publisher.join()
    process, log = start_consume(db_url, config, tmp_path)
    try:
        assert wait_until(lambda: count_events(app) == 2000 and drained(), 90), _log(log)
    finally:
        code = _terminate(process, log)
    assert code == 0, _log(log)
    _keys_once(app, 2000, prefix)
    assert drained()


AGAIN = [*range(0, 700, 7), *range(3, 700, 7), *range(5, 700, 7)]


@pytest.mark.parametrize("broker", ["rabbitmq", "nats"])
def test_kill9_after_a_stream_with_duplicates_loses_none_of_their_counts(
    make_app, db_url, tmp_path, broker, request
):
    # 700 messages, 300 of them sent twice (AGAIN); once all are acknowledged the
    # consumer is killed outright. Its redeliveries' counts were written
    # before their acks: all 300 are there (the ledger's interval is set
    # long, so a count still waiting in it would be lost).
    if broker == "rabbitmq":
        queue = request.getfixturevalue("amqp_queue")
        sources = {"feed": rabbit_source(queue, prefetch=100)}
        queue.publish([amqp_message(n) for n in range(700)] + [amqp_message(n) for n in AGAIN])

        def drained() -> bool:
            return queue.ready() == 0
    else:
        stream = request.getfixturevalue("jetstream")
        sources = {"feed": nats_source(stream, batch=100, dedup_key="json:/payment")}
        stream.publish([nats_message(n) for n in range(700)])
        # Under a json: key (JetStream drops a repeated Nats-Msg-Id at publish).
        stream.publish([("paid", json.dumps({"payment": n}).encode(), {}) for n in AGAIN])

        def drained() -> bool:
            return stream.pending() == (0, 0)

    app = make_app({"sources": sources})
    process, log = start_consume(
        db_url, toml(sources), tmp_path, env={"WEBHOOK_RECEIVER_DUPLICATE_FLUSH_SECONDS": "60"}
    )
    try:
        assert wait_until(lambda: count_events(app) == 700 and drained(), 60), _log(log)
        time.sleep(1)  # the acks of the last batch stored (a RabbitMQ queue counts ready ones)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    finally:
        stop(process)
    assert drained()  # every message was acknowledged: none comes back to be counted again
    assert duplicate_total(app) == 300, _log(log)


def _hold_writers(db_url: str) -> Any:
    """Make the app's writers wait (without failing) from outside; return a release function."""
    if db_url.startswith("sqlite"):
        # The writers' turn another process of the app holds (database.SQLiteWriterTurns):
        # a writer waits for it up to the busy timeout.
        fd = os.open(db_url.removeprefix("sqlite:///") + "-writers.lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)

        def release() -> None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

        return release
    engine = create_engine(db_url)
    conn = engine.connect()
    conn.execute(text(f"LOCK TABLE {Event.__tablename__} IN EXCLUSIVE MODE"))

    def release_pg() -> None:
        conn.rollback()
        conn.close()
        engine.dispose()

    return release_pg


@pytest.mark.parametrize("broker", ["rabbitmq", "nats"])
def test_sigterm_mid_batch_commits_and_acks_then_exits_0(
    make_app, db_url, tmp_path, broker, request
):
    if broker == "rabbitmq":
        queue = request.getfixturevalue("amqp_queue")
        sources = {"feed": rabbit_source(queue, prefetch=500)}
        publish, messages = queue.publish, [amqp_message(n) for n in range(300)]

        def taken() -> bool:  # the consumer holds a batch, none of it settled
            return queue.ready() < 300

        def unsettled() -> int:  # with the consumer gone, unacked messages are ready again
            return queue.ready()
    else:
        stream = request.getfixturevalue("jetstream")
        sources = {"feed": nats_source(stream, batch=500)}
        publish, messages = stream.publish, [nats_message(n) for n in range(300)]

        def taken() -> bool:
            return stream.pending()[1] > 0

        def unsettled() -> int:
            pending, ack_pending = stream.pending()
            assert ack_pending == 0  # what it fetched, it settled
            return pending

    app = make_app({"sources": sources})
    process, log = start_consume(db_url, toml(sources), tmp_path)
    try:
        assert wait_until(lambda: "consuming" in log.read_text(), 30), _log(log)
        release = _hold_writers(db_url)
        try:
            publish(messages)
            assert wait_until(taken, 30), _log(log)
            time.sleep(0.3)  # the batch is in its transaction, waiting for the database
            process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert process.poll() is None  # it does not walk away from its batch
        finally:
            release()
        code = process.wait(timeout=30)
    finally:
        stop(process)
    assert code == 0, _log(log)
    stored = count_events(app)
    assert stored > 0, _log(log)  # the batch in hand was committed
    # Everything else is still the broker's: nothing acked that is not stored.
    assert stored + unsettled() == 300


def test_rabbitmq_connection_closed_by_the_broker_reconnects(
    make_app, db_url, tmp_path, amqp_queue
):
    sources = {"feed": rabbit_source(amqp_queue, prefetch=50)}
    app = make_app({"sources": sources})
    messages = [amqp_message(n) for n in range(1500)]
    process, log = start_consume(db_url, toml(sources), tmp_path)
    try:
        publisher = _publish_in_background(amqp_queue.publish, messages)
        assert wait_until(lambda: count_events(app) >= 200, 60), _log(log)
        name = f"webhook-receiver consume feed pid {process.pid}"
        assert _close_rabbit_connection(name), "the consumer's connection was not found"
        publisher.join()
        assert wait_until(lambda: count_events(app) == 1500 and amqp_queue.ready() == 0, 90), _log(
            log
        )
    finally:
        code = _terminate(process, log)
    assert code == 0
    assert "broker unavailable" in log.read_text()
    _keys_once(app, 1500, "m-")


def _close_rabbit_connection(connection_name: str) -> bool:
    listing = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "pid", "client_properties"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for line in listing.splitlines():
        if connection_name in line:
            pid = line.split("\t", 1)[0]
            subprocess.run(
                ["rabbitmqctl", "-q", "close_connection", pid, "closed by a test"],
                timeout=60,
                check=True,
            )
            return True
    return False


def test_nats_server_restarted_mid_stream_nothing_lost_or_doubled(make_app, db_url, tmp_path):
    from .conftest import Stream, private_nats

    with private_nats(tmp_path) as server:
        stream = Stream(server.url, "WRRESTART", "wrrestart")
        stream.create()
        _short_ack_wait(stream)
        sources = {"pay": nats_source(stream, batch=100)}
        app = make_app({"sources": sources})
        messages = [nats_message(n) for n in range(1500)]
        process, log = start_consume(db_url, toml(sources), tmp_path)
        try:
            publisher = threading.Thread(target=_publish_through_restarts, args=(stream, messages))
            publisher.start()
            assert wait_until(lambda: count_events(app) >= 200, 60), _log(log)
            server.restart()
            publisher.join()
            assert wait_until(
                lambda: count_events(app) == 1500 and stream.pending() == (0, 0), 90
            ), _log(log)
        finally:
            code = _terminate(process, log)
        assert code == 0
        _keys_once(app, 1500, "p-")


def _publish_through_restarts(stream: Any, messages: list[Any]) -> None:
    # A producer's own retries: a publish cut by the restart is sent again
    # with the same Nats-Msg-Id (JetStream drops it if it had been stored).
    for i in range(0, len(messages), 50):
        for _ in range(100):
            try:
                stream.publish(messages[i : i + 50])
                break
            except Exception:
                time.sleep(0.2)
        else:
            raise AssertionError("could not publish through the restart")


def _outage_setup(broker: str, request: Any) -> tuple[dict[str, Any], Any, Any, Any, str]:
    """The source, publisher, the broker's unsettled count and a drained check."""
    if broker == "rabbitmq":
        queue = request.getfixturevalue("amqp_queue")

        def held() -> int:
            # Ready, plus at most the three batches the consumer holds
            # unacked (one storing, one prepared, one arriving).
            return queue.ready() + 3 * 50

        return (
            {"feed": rabbit_source(queue, prefetch=50)},
            lambda ns: queue.publish([amqp_message(n) for n in ns]),
            held,
            lambda: queue.ready() == 0,
            "m-",
        )
    stream = request.getfixturevalue("jetstream")

    def unsettled() -> int:
        pending, ack_pending = stream.pending()
        return pending + ack_pending

    return (
        {"feed": nats_source(stream, batch=50)},
        lambda ns: stream.publish([nats_message(n) for n in ns]),
        unsettled,
        lambda: stream.pending() == (0, 0),
        "p-",
    )


def _count(url: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(f"SELECT count(*) FROM {Event.__tablename__}")).scalar_one()
    finally:
        engine.dispose()


def _keys(url: str) -> Counter[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return Counter(
                conn.execute(text(f"SELECT dedup_key FROM {Event.__tablename__}")).scalars()
            )
    finally:
        engine.dispose()


@pytest.mark.parametrize("broker", ["rabbitmq", "nats"])
def test_postgresql_stopped_mid_stream_nothing_acked_until_committed(
    stoppable_postgres, tmp_path, broker, request
):
    pg = stoppable_postgres
    sources, publish, unsettled, drained, prefix = _outage_setup(broker, request)
    process, log = start_consume(pg.url, toml(sources), tmp_path)
    try:
        publish(range(500))
        assert wait_until(lambda: _count(pg.url) == 500 and drained(), 60), _log(log)
        pg.stop("immediate")
        publish(range(500, 1000))
        assert wait_until(lambda: "database unavailable" in log.read_text(), 30), _log(log)
        time.sleep(2)
        assert process.poll() is None  # a transient error never ends the consumer
        assert unsettled() >= 500  # nothing acked that was not committed
        pg.start()
        assert wait_until(lambda: _count(pg.url) == 1000 and drained(), 90), _log(log)
    finally:
        code = _terminate(process, log)
    assert code == 0
    assert log.read_text().count("database unavailable") == 1  # logged once per outage
    keys = _keys(pg.url)
    assert set(keys) == {f"{prefix}{n}" for n in range(1000)} and max(keys.values()) == 1


@pytest.mark.parametrize("broker", ["rabbitmq", "nats"])
def test_sqlite_write_locked_mid_stream_nothing_acked_until_committed(
    _sqlite_template, tmp_path, broker, request
):
    path = tmp_path / "locked.sqlite3"
    shutil.copyfile(_sqlite_template, path)
    url = f"sqlite:///{path}"
    sources, publish, unsettled, drained, prefix = _outage_setup(broker, request)
    process, log = start_consume(url, toml(sources), tmp_path)
    try:
        publish(range(500))
        assert wait_until(lambda: _count(url) == 500 and drained(), 60), _log(log)
        # Another process (a backup, a migration, a stuck script) holds the write lock.
        holder = sqlite3.connect(path, isolation_level=None, timeout=30)
        holder.execute("BEGIN IMMEDIATE")
        try:
            publish(range(500, 1000))
            assert wait_until(lambda: "database unavailable" in log.read_text(), 30), _log(log)
            time.sleep(2)
            assert process.poll() is None
            assert _count(url) == 500  # readers go on in WAL mode: nothing committed
            assert unsettled() >= 500  # and nothing acked
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert wait_until(lambda: _count(url) == 1000 and drained(), 90), _log(log)
    finally:
        code = _terminate(process, log)
    assert code == 0
    keys = _keys(url)
    assert set(keys) == {f"{prefix}{n}" for n in range(1000)} and max(keys.values()) == 1


@pytest.mark.parametrize("when", ["lost mid-session", "down at start"])
def test_sigterm_while_nats_is_unreachable_exits_0_and_the_outage_is_logged(
    make_app, db_url, tmp_path, when
):
    # nats-py retries a first connect for ever when told to reconnect for
    # ever: the consumer used to sit in it, deaf to SIGTERM, and a lost
    # connection was retried without a word in the log.
    from .conftest import Stream, private_nats

    with private_nats(tmp_path) as server:
        stream = Stream(server.url, "WRDOWN", "wrdown")
        stream.create()
        sources = {"pay": nats_source(stream, batch=10)}
        if when == "down at start":
            server.stop()
        process, log = start_consume(db_url, toml(sources), tmp_path)
        try:
            if when == "lost mid-session":
                assert wait_until(lambda: "consuming" in log.read_text(), 30), _log(log)
                server.stop()
            assert wait_until(lambda: "broker unavailable" in log.read_text(), 30), _log(log)
            time.sleep(1)  # in the middle of connecting again
            code = _terminate(process, log)
        finally:
            stop(process)
    assert code == 0, _log(log)
    assert log.read_text().count("broker unavailable") == 1, _log(log)
