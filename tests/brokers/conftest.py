"""Fixtures for broker tests: the real RabbitMQ and NATS on 127.0.0.1, a queue or stream each.

Each test declares its own uniquely named queue (with a dead-letter
exchange and queue) or stream, and deletes it afterwards. A broker that is
down skips its tests, except in CI (``CI`` set), where it fails them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pika
import pytest
from flask import Flask
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from sqlalchemy import func, select

from webhook_receiver.brokers import runner
from webhook_receiver.extensions import db
from webhook_receiver.models import Event, EventConflict, Rejection
from webhook_receiver.observability import metrics

from ..faults.conftest import stoppable_postgres  # noqa: F401  (a fixture, used by name)
from ..helpers import unavailable
from ..helpers import unreachable as _unavailable  # the fixture modules' name for it
from ..servers import BIN, ROOT, app_env, free_port, stop, wait_until
from .cloud_fixtures import (  # noqa: F401  (fixtures)
    pubsub_host,
    pubsub_subscription,
    sqs_endpoint,
    sqs_queue,
)
from .mqtt_fixtures import mqtt_broker, mqtt_topics  # noqa: F401  (fixtures)
from .redis_fixtures import redis_stream, redis_url  # noqa: F401  (fixtures)

RABBIT_URL = os.environ.get("TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
NATS_URL = os.environ.get("TEST_NATS_URL", "nats://127.0.0.1:4222")


@pytest.fixture(scope="session")
def rabbit_url() -> str:
    """The test RabbitMQ's URL, once it has been seen to answer."""
    try:
        pika.BlockingConnection(pika.URLParameters(RABBIT_URL)).close()
    except Exception as exc:
        _unavailable("RabbitMQ", exc)
    return RABBIT_URL


@pytest.fixture(scope="session")
def nats_url() -> str:
    """The test NATS server's URL, once it has been seen to answer with JetStream."""

    async def check() -> None:
        nc = await nats.connect(NATS_URL, connect_timeout=2, max_reconnect_attempts=0)
        try:
            await nc.jetstream().account_info()
        finally:
            await nc.close()

    try:
        asyncio.run(check())
    except Exception as exc:
        _unavailable("NATS JetStream", exc)
    return NATS_URL


# -- RabbitMQ -----------------------------------------------------------------


@dataclass
class Queue:
    """A test's queue, its dead-letter exchange and the queue that exchange feeds."""

    url: str
    name: str

    @property
    def dead(self) -> str:
        return f"{self.name}.dead"

    @property
    def dlx(self) -> str:
        return f"{self.name}.dlx"

    @contextmanager
    def channel(self) -> Iterator[Any]:
        connection = pika.BlockingConnection(pika.URLParameters(self.url))
        try:
            yield connection.channel()
        finally:
            connection.close()

    def publish(self, messages: list[tuple[bytes, dict[str, Any]]]) -> None:
        """Publish (body, properties) pairs to the queue, with publisher confirms."""
        with self.channel() as ch:
            ch.confirm_delivery()
            for body, props in messages:
                ch.basic_publish("", self.name, body, pika.BasicProperties(**props))

    def ready(self, queue: str | None = None) -> int:
        """Messages ready in the queue (unacknowledged ones come back when their consumer goes)."""
        with self.channel() as ch:
            return ch.queue_declare(queue or self.name, passive=True).method.message_count

    def take_all(self, queue: str) -> list[tuple[Any, bytes]]:
        """Take (and ack) every message of ``queue``: (properties, body) pairs."""
        taken = []
        with self.channel() as ch:
            while True:
                method, props, body = ch.basic_get(queue, auto_ack=True)
                if method is None:
                    return taken
                taken.append((props, body))


@pytest.fixture
def amqp_queue(rabbit_url: str) -> Iterator[Queue]:
    """A fresh queue with a dead-letter exchange and queue, deleted afterwards."""
    queue = Queue(rabbit_url, f"wr-test-{uuid.uuid4().hex[:10]}")
    with queue.channel() as ch:
        ch.exchange_declare(queue.dlx, "fanout", auto_delete=False)
        ch.queue_declare(queue.dead)
        ch.queue_bind(queue.dead, queue.dlx)
        ch.queue_declare(queue.name, arguments={"x-dead-letter-exchange": queue.dlx})
    yield queue
    with queue.channel() as ch:
        for name in (queue.name, queue.dead):
            ch.queue_delete(name)
        ch.exchange_delete(queue.dlx)


def rabbit_source(queue: Queue, **extra: Any) -> dict[str, Any]:
    """A broker source table consuming ``queue``."""
    return {"provider": "rabbitmq", "url": queue.url, "queue": queue.name, **extra}


# -- NATS -----------------------------------------------------------------------


@dataclass
class Stream:
    """A test's JetStream stream (subjects ``<prefix>.>``) and its dead-letter stream."""

    url: str
    name: str
    prefix: str
    created: list[str] = field(default_factory=list)

    @property
    def dead_subject(self) -> str:
        return f"{self.prefix}-dead"

    def run(self, coro_fn: Callable[[Any], Any]) -> Any:
        async def main() -> Any:
            nc = await nats.connect(self.url, connect_timeout=2, max_reconnect_attempts=5)
            try:
                return await coro_fn(nc)
            finally:
                await nc.close()

        return asyncio.run(main())

    def create(self) -> None:
        """Create the stream and its dead-letter stream."""

        async def go(nc: Any) -> None:
            js = nc.jetstream()
            await js.add_stream(StreamConfig(name=self.name, subjects=[f"{self.prefix}.>"]))
            await js.add_stream(
                StreamConfig(name=self.name + "_DEAD", subjects=[self.dead_subject])
            )

        self.run(go)

    def delete(self) -> None:
        """Delete both streams."""

        async def go(nc: Any) -> None:
            js = nc.jetstream()
            for name in (self.name, self.name + "_DEAD", *self.created):
                try:
                    await js.delete_stream(name)
                except Exception:
                    pass

        self.run(go)

    def publish(self, messages: list[tuple[str, bytes, dict[str, str]]]) -> None:
        """Publish (subject suffix, body, headers) to the stream, each waiting for its PubAck."""

        async def go(nc: Any) -> None:
            js = nc.jetstream()
            for suffix, body, headers in messages:
                await js.publish(f"{self.prefix}.{suffix}", body, headers=headers or None)

        self.run(go)

    def pending(self, durable: str = "webhook-receiver") -> tuple[int, int]:
        """The durable consumer's (pending, ack pending) counts."""

        async def go(nc: Any) -> tuple[int, int]:
            info = await nc.jetstream().consumer_info(self.name, durable)
            return info.num_pending, info.num_ack_pending

        return self.run(go)

    def delivered(self, durable: str = "webhook-receiver") -> int:
        """How many deliveries the durable consumer has made, redeliveries included."""

        async def go(nc: Any) -> int:
            try:
                info = await nc.jetstream().consumer_info(self.name, durable)
            except nats.js.errors.NotFoundError:
                return 0  # the consumer has not created it yet
            return info.delivered.consumer_seq

        return self.run(go)

    def short_ack_wait(self, durable: str = "webhook-receiver") -> None:
        """Create the durable consumer with a 2 s ack wait, before any consumer process does.

        A killed consumer's messages then come back after 2 s rather than 30.
        """

        async def go(nc: Any) -> None:
            config = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=2)
            await nc.jetstream().add_consumer(self.name, config)

        self.run(go)

    def add_stream(self, suffix: str, subject: str) -> str:
        """Create one more stream (``<name>_<suffix>``) on ``subject``, deleted with the others."""
        name = f"{self.name}_{suffix}"

        async def go(nc: Any) -> None:
            await nc.jetstream().add_stream(StreamConfig(name=name, subjects=[subject]))

        self.run(go)
        self.created.append(name)
        return name

    def dead_letters(self) -> list[Any]:
        """The messages stored on the dead-letter subject: (data, headers)."""
        return self.messages("DEAD")

    def messages(self, suffix: str) -> list[Any]:
        """The messages stored in the stream ``<name>_<suffix>``: (data, headers)."""
        name = f"{self.name}_{suffix}"

        async def go(nc: Any) -> list[Any]:
            js = nc.jetstream()
            info = await js.stream_info(name)
            out = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                if info.state.messages == 0:
                    break
                msg = await js.get_msg(name, seq)
                out.append((msg.data, msg.headers or {}))
            return out

        return self.run(go)


@pytest.fixture
def jetstream(nats_url: str) -> Iterator[Stream]:
    """A fresh stream (and a dead-letter stream), deleted afterwards."""
    tag = uuid.uuid4().hex[:10]
    stream = Stream(nats_url, f"WRTEST_{tag}", f"wrtest-{tag}")
    stream.create()
    yield stream
    stream.delete()


@dataclass
class PrivateNats:
    """A nats-server of a test's own (JetStream on, its own store), to stop and start at will."""

    store: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [NATS_SERVER, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

        async def ping() -> None:
            nc = await nats.connect(self.url, connect_timeout=1, max_reconnect_attempts=0)
            await nc.jetstream().account_info()
            await nc.close()

        def up() -> bool:
            try:
                asyncio.run(ping())
                return True
            except Exception:
                return False

        assert wait_until(up, 30), "the private nats-server did not start"

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)
            self.process = None

    def restart(self) -> None:
        """Stop the server (its clients are cut off) and start it again on the same store."""
        self.stop()
        self.start()


NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"


@contextmanager
def private_nats(tmp_path: Path) -> Iterator[PrivateNats]:
    """A private nats-server on a free port, stopped when the block ends."""
    if not os.path.exists(NATS_SERVER):
        unavailable("nats-server not found")
    server = PrivateNats(tmp_path / "nats-store", free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


def nats_source(stream: Stream, **extra: Any) -> dict[str, Any]:
    """A broker source table consuming ``stream``."""
    return {
        "provider": "nats",
        "url": stream.url,
        "stream": stream.name,
        "dead_letter_subject": stream.dead_subject,
        **extra,
    }


# -- consumers, in this process or as `flask consume` ---------------------------


@contextmanager
def consuming(app: Flask, source: str) -> Iterator[threading.Event]:
    """Run the consumer of ``source`` in a thread until the block ends (then stop it)."""
    stop_flag = threading.Event()
    consumer = runner.consumer_for(app, app.config["FILE_CONFIG"].brokers[source], stop_flag)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            consumer.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield stop_flag
    finally:
        stop_flag.set()
        thread.join(30)
    assert not thread.is_alive(), "the consumer did not stop"
    if errors:
        raise errors[0]


def count_events(app: Flask, source: str | None = None) -> int:
    """How many events are stored (of ``source``)."""
    with app.app_context():
        query = select(func.count()).select_from(Event)
        if source is not None:
            query = query.where(Event.source == source)
        count = db.session.execute(query).scalar_one()
        db.session.rollback()
        return count


def stored_keys(app: Flask) -> list[str]:
    """Every stored event's dedup key (a key stored twice appears twice)."""
    with app.app_context():
        keys = list(db.session.execute(select(Event.dedup_key)).scalars())
        db.session.rollback()
        return keys


def count_conflicts(app: Flask) -> int:
    with app.app_context():
        n = db.session.execute(select(func.count()).select_from(EventConflict)).scalar_one()
        db.session.rollback()
        return n


def duplicate_total(app: Flask) -> int:
    """The sum of the stored events' duplicate counts."""
    with app.app_context():
        total = db.session.execute(select(func.sum(Event.duplicate_count))).scalar_one()
        db.session.rollback()
        return int(total or 0)


def start_consume(
    db_url: str, config_toml: str, tmp_path: Path, *sources: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start a real ``flask --app wsgi consume`` process; return it and its log path."""
    config_path = tmp_path / f"consume-{time.monotonic_ns()}.toml"
    config_path.write_text(config_toml)
    log_path = tmp_path / f"consume-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [str(BIN / "flask"), "--app", "wsgi", "consume", *sources],
            cwd=ROOT,
            env=app_env(
                db_url, config_path, {"WEBHOOK_RECEIVER_LOG_FORMAT": "text", **(env or {})}
            ),  # noqa: E501
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, log_path


__all__ = ["stop", "wait_until"]


def dead_letter_count(app: Flask, source: str, reason: str) -> float:
    """``webhook_receiver_broker_dead_letters_total`` of ``source`` for ``reason``."""
    registry = app.extensions[metrics.EXTENSION].registry
    labels = {"source": source, "reason": reason}
    with app.app_context():  # the registry's collectors read the database too
        value = registry.get_sample_value("webhook_receiver_broker_dead_letters_total", labels)
    return value or 0


def rejections(app: Flask, source: str) -> dict[str, int]:
    """The admin's Rejections for ``source``: reason -> how many."""
    with app.app_context():
        rows = db.session.execute(
            select(Rejection.reason, func.sum(Rejection.seen_count))
            .where(Rejection.source == source)
            .group_by(Rejection.reason)
        ).all()
        db.session.rollback()
        return {reason: int(count) for reason, count in rows}


# -- Kafka (Tansu, tests/tansu.py) ---------------------------------------------


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """The test Kafka broker's ``host:port``: Tansu, started once per session."""
    from .. import tansu

    try:
        return tansu.bootstrap()
    except Exception as exc:
        _unavailable("Kafka (Tansu)", exc)
        raise


@dataclass
class Topic:
    """A test's Kafka topic (``partitions`` of them), its dead-letter topic and consumer group."""

    bootstrap: str
    name: str
    partitions: int = 1
    published: int = 0
    # Per partition, the offset after the last record published (from the
    # delivery reports: Tansu's high watermark is not the log's end).
    ends: dict[int, int] = field(default_factory=dict)
    _producer: Any = None

    @property
    def dead(self) -> str:
        return f"{self.name}.dead"

    @property
    def group(self) -> str:
        return f"{self.name}-group"

    def create(self) -> None:
        from ..tansu import create_topic

        create_topic(self.bootstrap, self.name, self.partitions)
        create_topic(self.bootstrap, self.dead, 1)

    def producer(self) -> Any:
        """One idempotent producer per topic, shared by the test's threads."""
        from confluent_kafka import Producer

        if self._producer is None:
            self._producer = Producer(
                {
                    "bootstrap.servers": self.bootstrap,
                    "enable.idempotence": True,
                    "acks": "all",
                    "log_level": 3,
                }
            )
        return self._producer

    def publish(self, records: list[tuple[bytes | None, bytes, list[tuple[str, bytes]]]]) -> None:
        """Publish (key, value, headers) records; every delivery report must be a success."""
        failed: list[Any] = []

        def report(error: Any, message: Any) -> None:
            if error is not None:
                failed.append(error)
            else:
                end = self.ends.get(message.partition(), 0)
                self.ends[message.partition()] = max(end, message.offset() + 1)

        producer = self.producer()
        for key, value, headers in records:
            producer.produce(self.name, value=value, key=key, headers=headers, on_delivery=report)
            producer.poll(0)
        assert producer.flush(30) == 0, "records left undelivered"
        assert not failed, failed
        self.published += len(records)

    def _reader(self) -> Any:
        from confluent_kafka import Consumer

        return Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": self.group,
                "enable.auto.commit": False,
            }
        )

    def lag(self) -> int:
        """Records past the group's committed offsets, over every partition."""
        from confluent_kafka import TopicPartition

        reader = self._reader()
        try:
            parts = [TopicPartition(self.name, p) for p in range(self.partitions)]
            committed = reader.committed(parts, timeout=10)
            return sum(self.ends.get(tp.partition, 0) - max(tp.offset, 0) for tp in committed)
        finally:
            reader.close()

    def read_all(self, topic: str, quiet: float = 1.5) -> list[Any]:
        """Every record of ``topic`` (partition 0) from its start, until ``quiet`` s bring none."""
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        reader = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"{topic}-reader-{uuid.uuid4().hex[:6]}",
                "enable.auto.commit": False,
            }
        )
        try:
            reader.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
            records: list[Any] = []
            last = time.monotonic()
            while time.monotonic() - last < quiet:
                came = [m for m in reader.consume(500, 0.25) if m.error() is None]
                if came:
                    records += came
                    last = time.monotonic()
            return records
        finally:
            reader.close()


@pytest.fixture
def kafka_topic(kafka_bootstrap: str) -> Topic:
    """A fresh topic of one partition, with its dead-letter topic (Tansu keeps them in memory)."""
    topic = Topic(kafka_bootstrap, f"wr-test-{uuid.uuid4().hex[:10]}")
    topic.create()
    return topic


def kafka_source(topic: Topic, **extra: Any) -> dict[str, Any]:
    """A broker source table consuming ``topic``, keys in the ``message-id`` header."""
    return {
        "provider": "kafka",
        "bootstrap_servers": topic.bootstrap,
        "topics": [topic.name],
        "group_id": topic.group,
        "dedup_key": "header:message-id",
        "event_type": "header:type",
        "dead_letter_topic": topic.dead,
        **extra,
    }
