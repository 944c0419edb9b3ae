"""Real ``flask --app wsgi consume`` processes: competing consumers, broker restarts and cuts."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

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
from .running import log_tail, publish_in_background, terminate, toml

pytestmark = pytest.mark.slow


def amqp_message(n: int) -> tuple[bytes, dict[str, Any]]:
    body = json.dumps({"order": n}).encode()
    return body, {"message_id": f"m-{n}", "type": "order", "content_type": "application/json"}


def nats_message(n: int) -> tuple[str, bytes, dict[str, str]]:
    return "paid", json.dumps({"payment": n}).encode(), {"Nats-Msg-Id": f"p-{n}"}


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
            assert wait_until(lambda log=log: started in log.read_text(), 30), log_tail(log)
        yield consumers
    finally:
        codes = [terminate(process, log) for process, log in consumers]
    assert codes == [0, 0], [log_tail(log) for _, log in consumers]


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
            log_tail(log) for _, log in consumers
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
        first = publish_in_background(jetstream.publish, [nats_message(n) for n in range(1000)])
        second = publish_in_background(jetstream.publish, again)
        first.join()
        second.join()
        assert wait_until(
            lambda: count_events(app) == 1000 and jetstream.pending() == (0, 0), 90
        ), [log_tail(log) for _, log in consumers]
    _keys_once(app, 1000, "")
    assert duplicate_total(app) == 300
    assert jetstream.pending() == (0, 0)
    # Both took part: each stored some of the events (a line per batch at INFO).
    assert all("batch stored" in log.read_text() for _, log in consumers)


def test_rabbitmq_connection_closed_by_the_broker_reconnects(
    make_app, db_url, tmp_path, amqp_queue
):
    sources = {"feed": rabbit_source(amqp_queue, prefetch=50)}
    app = make_app({"sources": sources})
    messages = [amqp_message(n) for n in range(1500)]
    process, log = start_consume(db_url, toml(sources), tmp_path)
    try:
        publisher = publish_in_background(amqp_queue.publish, messages)
        assert wait_until(lambda: count_events(app) >= 200, 60), log_tail(log)
        name = f"webhook-receiver consume feed pid {process.pid}"
        assert _close_rabbit_connection(name), "the consumer's connection was not found"
        publisher.join()
        assert wait_until(lambda: count_events(app) == 1500 and amqp_queue.ready() == 0, 90), (
            log_tail(log)
        )
    finally:
        code = terminate(process, log)
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
        stream.short_ack_wait()
        sources = {"pay": nats_source(stream, batch=100)}
        app = make_app({"sources": sources})
        messages = [nats_message(n) for n in range(1500)]
        process, log = start_consume(db_url, toml(sources), tmp_path)
        try:
            publisher = threading.Thread(target=_publish_through_restarts, args=(stream, messages))
            publisher.start()
            assert wait_until(lambda: count_events(app) >= 200, 60), log_tail(log)
            server.restart()
            publisher.join()
            assert wait_until(
                lambda: count_events(app) == 1500 and stream.pending() == (0, 0), 90
            ), log_tail(log)
        finally:
            code = terminate(process, log)
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
                assert wait_until(lambda: "consuming" in log.read_text(), 30), log_tail(log)
                server.stop()
            assert wait_until(lambda: "broker unavailable" in log.read_text(), 30), log_tail(log)
            time.sleep(1)  # in the middle of connecting again
            code = terminate(process, log)
        finally:
            stop(process)
    assert code == 0, log_tail(log)
    assert log.read_text().count("broker unavailable") == 1, log_tail(log)
