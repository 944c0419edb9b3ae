"""Kafka rounds for ``python -m bench.brokers --broker kafka`` (see bench/brokers.py).

One topic (one partition) filled once per round by an idempotent producer,
read from its start by one consumer group per run:

- ``bare``: the consumer ``flask consume`` runs (offsets = "kafka"), with a
  unit of work that stores nothing: consume and commit to Kafka;
- ``floor``: the least a storing consumer can do, straight on the drivers:
  confluent-kafka's consume(), one multi-row ``INSERT ... ON CONFLICT DO
  NOTHING`` of the keys and bodies per batch and its commit (psycopg or
  sqlite3), then an asynchronous commit to Kafka; in the process settings
  of the consumers (runner.consuming);
- ``unique``: the consumer storing every record with its offsets in the
  batch's transaction (offsets = "inbox");
- ``redeliveries``: a second stored group over the same records, every one a
  duplicate (the source's stored offsets are deleted first: kept per source,
  they would have the second group read on after the first);
- then ``bare`` again (its time is the mean of the two).

Each run is timed from its group's first assignment (joining a group takes
a second or so on Tansu) to its last record settled. The broker is
``BENCH_KAFKA_BOOTSTRAP``, else a Tansu started here (tests/tansu.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .broker_rounds import Round, fresh_name, key
from .cpu import metered

RUNS = ("bare", "floor", "unique", "again", "bare-after")
TIMEOUT_SECONDS = 600.0


def bootstrap() -> str:
    """The Kafka broker the bench runs against."""
    given = os.environ.get("BENCH_KAFKA_BOOTSTRAP")
    if given:
        return given
    from tests.tansu import bootstrap as tansu

    return tansu()


def kafka_times(rnd: Round, bare: tuple[Any, Any]) -> dict[str, float]:
    """Seconds for each of RUNS over one topic of ``n`` records (the round's consume unused)."""
    from tests.tansu import create_topic

    db_url, n, size = rnd.db_url, rnd.n, rnd.size
    servers = bootstrap()
    topic = fresh_name()
    create_topic(servers, topic)
    _fill(servers, topic, n, rnd.body)
    times: dict[str, float] = {}
    for run in RUNS:
        group = f"{topic}-{run}"
        if run == "floor":
            times[run] = _floor(servers, topic, group, db_url, n, size)
            continue
        table = {
            "provider": "kafka",
            "bootstrap_servers": servers,
            "topics": [topic],
            "group_id": group,
            "dedup_key": "header:message-id",
            "event_type": "header:type",
            "batch": size,
            "offsets": "kafka" if run.startswith("bare") else "inbox",
        }
        app = rnd.make_app(db_url, table)
        if run == "again":
            _forget_positions(app)
        times[run] = _consume(app, n, bare if run.startswith("bare") else None)
    return times


def _forget_positions(app: Any) -> None:
    from sqlalchemy import text

    from webhook_receiver.extensions import db

    with app.app_context():
        db.session.execute(text("DELETE FROM broker_positions WHERE source = 'bench'"))
        db.session.commit()


def _fill(servers: str, topic: str, n: int, body: Callable[[str, int], bytes]) -> None:
    from confluent_kafka import Producer

    producer = Producer(
        {
            "bootstrap.servers": servers,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "log_level": 3,
        }
    )
    for i in range(n):
        message_id = key(topic, i)
        headers = [
            ("message-id", message_id.encode()),
            ("type", b"order.paid"),
            ("content-type", b"application/json"),
        ]
        while True:
            try:
                producer.produce(topic, value=body(message_id, i), headers=headers)
                break
            except BufferError:
                producer.poll(0.05)  # the local queue is full: let it drain
        producer.poll(0)
    if producer.flush(60):
        raise RuntimeError("the bench's records were not all delivered")


def _consume(app: Any, count: int, bare: tuple[Any, Any] | None) -> float:
    """Run the source's consumer until ``count`` records are settled; seconds from joining."""
    from webhook_receiver.brokers import runner

    stop = threading.Event()
    consumer: Any = runner.consumer_for(app, app.config["FILE_CONFIG"].brokers["bench"], stop)
    if bare is not None:
        consumer.prepare, consumer.store = bare
    thread = threading.Thread(target=consumer.run)
    # As ``flask consume`` runs its consumers (runner.run).
    with runner.consuming(), metered("kafka"):
        thread.start()
        deadline = time.perf_counter() + TIMEOUT_SECONDS
        while not consumer._joined and time.perf_counter() < deadline:
            time.sleep(0.001)
        started = time.perf_counter()
        while consumer.settled < count and time.perf_counter() < deadline:
            time.sleep(0.002)
        elapsed = time.perf_counter() - started
        stop.set()
        thread.join(30)
    if consumer.settled < count:
        raise RuntimeError(f"only {consumer.settled} of {count} settled")
    return elapsed


def _floor(servers: str, topic: str, group: str, db_url: str, n: int, size: int) -> float:
    """The bare storing loop: consume, one multi-row INSERT and its commit, commit to Kafka."""
    from confluent_kafka import Consumer

    from webhook_receiver.brokers import runner

    joined = threading.Event()

    def on_assign(consumer: Any, partitions: list[Any]) -> None:
        consumer.incremental_assign(partitions)
        joined.set()

    consumer = Consumer(
        {
            "bootstrap.servers": servers,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
            "log_level": 3,
        }
    )
    insert, conn = _driver(db_url)
    consumer.subscribe([topic], on_assign=on_assign)
    try:
        # In the same process settings as the consumers it is compared with.
        with runner.consuming(), metered("kafka"):
            elapsed, stored = _store_all(consumer, joined, insert, conn, n, size)
    finally:
        consumer.close()
        conn.close()
    if stored < n:
        raise RuntimeError(f"the floor loop stored {stored} of {n}")
    return elapsed


def _store_all(
    consumer: Any,
    joined: threading.Event,
    insert: Callable[[list[tuple[str, bytes]]], None],
    conn: Any,
    n: int,
    size: int,
) -> tuple[float, int]:
    """The floor's loop until ``n`` records are stored: seconds from joining, and how many."""
    stored = 0
    started: float | None = None
    deadline = time.perf_counter() + TIMEOUT_SECONDS
    while stored < n and time.perf_counter() < deadline:
        records = [r for r in consumer.consume(size, 0.05) if r.error() is None]
        if started is None and joined.is_set():
            started = time.perf_counter()
        if not records:
            continue
        rows = [(dict(r.headers())["message-id"].decode(), r.value()) for r in records]
        insert(rows)
        conn.commit()
        consumer.commit(asynchronous=True)
        stored += len(records)
    return time.perf_counter() - (started or deadline), stored


def _driver(db_url: str) -> tuple[Callable[[list[tuple[str, bytes]]], None], Any]:
    """A multi-row insert of (key, body) rows on the bare driver, and its connection."""
    if db_url.startswith("sqlite"):
        import sqlite3

        conn = sqlite3.connect(db_url.removeprefix("sqlite:///"), timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE IF NOT EXISTS bench_floor (key TEXT PRIMARY KEY, body BLOB)")
        conn.commit()
        marks = "(?, ?)"
    else:
        import psycopg

        conn = psycopg.connect(db_url.replace("postgresql+psycopg://", "postgresql://"))
        conn.execute("CREATE TABLE IF NOT EXISTS bench_floor (key TEXT PRIMARY KEY, body BYTEA)")
        conn.commit()
        marks = "(%s, %s)"

    def insert(rows: list[tuple[str, bytes]]) -> None:
        values = ", ".join([marks] * len(rows))
        flat = [value for row in rows for value in row]
        conn.execute(
            f"INSERT INTO bench_floor (key, body) VALUES {values} ON CONFLICT DO NOTHING", flat
        )

    return insert, conn
