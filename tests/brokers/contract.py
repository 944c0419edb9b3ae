"""Each broker as the contract suite sees it: one small class per broker, the same methods.

tests/brokers/test_contract.py holds every broker adapter to the same
promises through these classes. Adding a broker is a class here and a line
in ``BROKERS``.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

import pytest

from .cloud_fixtures import SqsQueue, Subscription, pubsub_source, sqs_source
from .conftest import Queue, Stream, Topic, kafka_source, nats_source, rabbit_source
from .mqtt_fixtures import MqttTopics, mqtt_source
from .redis_fixtures import RedisStream, redis_source


class Message(NamedTuple):
    """A message as a producer sends it: its key (None: sent without one), body and type."""

    key: str | None
    body: bytes
    type: str = "order"


def numbered(n: int, total: int | None = None) -> Message:
    """The n-th message of a stream, its key ``m-<n>``."""
    body = json.dumps({"n": n, "total": n if total is None else total}).encode()
    return Message(f"m-{n}", body)


class DeadLetter(NamedTuple):
    """A dead-lettered message: its key and body as sent, and the reason if the broker keeps one."""

    key: str | None
    body: bytes
    reason: str | None


class BrokerUnderTest:
    """What the contract suite needs of a broker; each subclass speaks one broker's idioms."""

    name: str
    # Messages the consumer may hold unacknowledged beyond one batch (read ahead).
    batches_held: int

    def source(self, batch: int, **extra: Any) -> dict[str, Any]:
        """A source table consuming this broker, ``batch`` messages at a time."""
        raise NotImplementedError

    def publish(self, messages: Sequence[Message]) -> None:
        """Publish each message, waiting for the broker to take it."""
        raise NotImplementedError

    def publish_malformed(self) -> None:
        """Publish one message whose key is not UTF-8 text (never decoded with replacements)."""
        raise NotImplementedError

    def expect_consumer_kill(self) -> None:
        """Before a consumer is killed: its unacknowledged messages come back within seconds."""

    def taken(self) -> int:
        """Messages delivered to a consumer so far, acknowledged or not."""
        raise NotImplementedError

    def unsettled(self) -> int:
        """Messages the broker holds that no consumer has acknowledged (an upper bound)."""
        raise NotImplementedError

    def left_after_stop(self) -> int:
        """With the consumer stopped cleanly: the messages it left to the broker, unacknowledged."""
        raise NotImplementedError

    def drained(self) -> bool:
        """Nothing left to deliver, nothing delivered and unacknowledged."""
        raise NotImplementedError

    def dead_letters(self) -> list[DeadLetter]:
        """Every dead-lettered message (read once, at a test's end)."""
        raise NotImplementedError


class RabbitMQ(BrokerUnderTest):
    """A queue with its dead-letter exchange and queue; keys in the message_id property."""

    name = "rabbitmq"
    batches_held = 3  # one storing, one prepared, one arriving

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        self.batch = 0
        self.published = 0

    def source(self, batch: int, **extra: Any) -> dict[str, Any]:
        self.batch = batch
        return rabbit_source(self.queue, prefetch=batch, **extra)

    def publish(self, messages: Sequence[Message]) -> None:
        self.queue.publish([(m.body, self._properties(m.key, m.type)) for m in messages])
        self.published += len(messages)

    def publish_malformed(self) -> None:
        self.queue.publish([(b'{"n": -1}', self._properties(b"m-\xff", "order"))])

    @staticmethod
    def _properties(key: str | bytes | None, type_: str) -> dict[str, Any]:
        props: dict[str, Any] = {"type": type_, "content_type": "application/json"}
        if key is not None:
            props["message_id"] = key
        return props

    def taken(self) -> int:
        return self.published - self.queue.ready()

    def unsettled(self) -> int:
        # A queue tells its ready messages only: add what a consumer may hold unacked.
        return self.queue.ready() + self.batches_held * self.batch

    def left_after_stop(self) -> int:
        # With its consumer gone, what it held unacked is ready again.
        return self.queue.ready()

    def drained(self) -> bool:
        return self.queue.ready() == 0

    def dead_letters(self) -> list[DeadLetter]:
        # The dead-letter exchange gets each message unchanged (its reason is in the log).
        return [
            DeadLetter(props.message_id, body, None)
            for props, body in self.queue.take_all(self.queue.dead)
        ]


KEY_HEADER = "Message-Key"


class NatsJetStream(BrokerUnderTest):
    """A stream and its dead-letter stream; keys in a header (not Nats-Msg-Id, which
    JetStream's own duplicate window would drop at publish)."""

    name = "nats"
    batches_held = 2  # one storing, one fetched

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def source(self, batch: int, **extra: Any) -> dict[str, Any]:
        return nats_source(self.stream, batch=batch, dedup_key=f"header:{KEY_HEADER}", **extra)

    def publish(self, messages: Sequence[Message]) -> None:
        self.stream.publish([(m.type, m.body, self._headers(m.key)) for m in messages])

    @staticmethod
    def _headers(key: str | None) -> dict[str, str]:
        headers = {"Nats-Msg-Id": uuid.uuid4().hex, "Content-Type": "application/json"}
        if key is not None:
            headers[KEY_HEADER] = key
        return headers

    def publish_malformed(self) -> None:
        publish_raw(
            self.stream.url,
            f"{self.stream.prefix}.order".encode(),
            [(KEY_HEADER.encode(), b"m-\xff")],
            b'{"n": -1}',
        )

    def expect_consumer_kill(self) -> None:
        self.stream.short_ack_wait()

    def taken(self) -> int:
        return self.stream.delivered()

    def unsettled(self) -> int:
        pending, ack_pending = self.stream.pending()
        return pending + ack_pending

    def left_after_stop(self) -> int:
        pending, ack_pending = self.stream.pending()
        assert ack_pending == 0  # what it fetched, it settled before it stopped
        return pending

    def drained(self) -> bool:
        return self.stream.pending() == (0, 0)

    def dead_letters(self) -> list[DeadLetter]:
        return [
            DeadLetter(headers.get(KEY_HEADER), data, headers.get("Dead-Letter-Reason"))
            for data, headers in self.stream.dead_letters()
        ]


def publish_raw(url: str, subject: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """Publish one message over the NATS wire protocol, bytes as given (nats-py would refuse)."""
    host, port = url.removeprefix("nats://").split(":")
    block = b"NATS/1.0\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in headers) + b"\r\n"
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        reader = sock.makefile("rb")
        assert reader.readline().startswith(b"INFO ")
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\n')
        sock.sendall(
            b"HPUB %s %d %d\r\n%s%s\r\nPING\r\n"
            % (subject, len(block), len(block) + len(body), block, body)
        )
        line = reader.readline()
        assert line == b"PONG\r\n", line


class RedisStreams(BrokerUnderTest):
    """A stream, its group and a dead-letter stream; keys in a ``message_id`` field.

    What is unacknowledged is the group's lag (not yet read) and its
    pending entries (read, not acknowledged).
    """

    name = "redis"
    batches_held = 2  # one storing, one read

    def __init__(self, stream: RedisStream) -> None:
        self.stream = stream
        self.claim_idle_seconds = 60

    def source(self, batch: int, **extra: Any) -> dict[str, Any]:
        extra.setdefault("claim_idle_seconds", self.claim_idle_seconds)
        return redis_source(self.stream, batch=batch, **extra)

    def publish(self, messages: Sequence[Message]) -> None:
        self.stream.publish([self._fields(m.key, m.type, m.body) for m in messages])

    @staticmethod
    def _fields(key: str | bytes | None, type_: str, body: bytes) -> dict[str, str | bytes]:
        fields: dict[str, str | bytes] = {"type": type_, "content_type": "application/json"}
        if key is not None:
            fields["message_id"] = key
        fields["body"] = body
        return fields

    def publish_malformed(self) -> None:
        self.stream.publish([self._fields(b"m-\xff", "order", b'{"n": -1}')])

    def expect_consumer_kill(self) -> None:
        # A killed consumer's entries are claimed by the next once idle this long.
        self.claim_idle_seconds = 2

    def taken(self) -> int:
        return int(self.stream.group()["entries-read"] or 0)

    def unsettled(self) -> int:
        return self.stream.unsettled()

    def left_after_stop(self) -> int:
        return self.stream.unsettled()

    def drained(self) -> bool:
        return self.stream.unsettled() == 0

    def dead_letters(self) -> list[DeadLetter]:
        out = []
        for fields in self.stream.dead_letters():
            key, reason = fields.get(b"message_id"), fields.get(b"dead_letter_reason")
            out.append(
                DeadLetter(
                    key.decode(errors="replace") if key is not None else None,
                    fields[b"body"],
                    reason.decode() if reason is not None else None,
                )
            )
        return out


class Mqtt(BrokerUnderTest):
    """Topics in a persistent session on the tests' Mosquitto; keys in a user property.

    What is unacknowledged is what was published and not yet PUBACKed by
    the consumer, as the broker's log counts them. Mosquitto refuses a
    user property that is not UTF-8 (it closes the publisher's
    connection), so the malformed message is one whose key is ambiguous:
    its ``message-id`` given twice.
    """

    name = "mqtt"
    batches_held = 3  # the session's Receive Maximum

    def __init__(self, topics: MqttTopics) -> None:
        self.topics = topics

    def source(self, batch: int, **extra: Any) -> dict[str, Any]:
        return mqtt_source(self.topics, batch=batch, **extra)

    def publish(self, messages: Sequence[Message]) -> None:
        self.topics.publish(
            [("device-1", m.body, self._properties(m.key, m.type)) for m in messages]
        )

    @staticmethod
    def _properties(key: str | None, type_: str) -> list[tuple[str, str]]:
        return [("type", type_), *([("message-id", key)] if key is not None else [])]

    def publish_malformed(self) -> None:
        twice = [("type", "order"), ("message-id", "m-3"), ("message-id", "m-4")]
        self.topics.publish([("device-1", b'{"n": -1}', twice)])

    def taken(self) -> int:
        return self.topics.sent()

    def unsettled(self) -> int:
        return self.topics.published - self.topics.acked()

    def left_after_stop(self) -> int:
        return self.unsettled()

    def drained(self) -> bool:
        return self.unsettled() == 0

    def dead_letters(self) -> list[DeadLetter]:
        return [
            DeadLetter(props.get("message-id"), payload, props.get("dead-letter-reason"))
            for payload, props in self.topics.dead_letters()
        ]


KEY_ATTRIBUTE = "message-id"


class Kafka(BrokerUnderTest):
    """A topic and its dead-letter topic on Tansu; keys in a ``message-id`` header.

    What is unacknowledged is the group's lag: the records past its
    committed offsets (committed after the database's commit, with
    ``offsets = "inbox"`` too).
    """

    name = "kafka"
    batches_held = 2  # one storing, one consumed

    def __init__(self, topic: Topic) -> None:
        self.topic = topic

    def source(self, batch: int, **extra: Any) -> dict[str, Any]:
        return kafka_source(self.topic, batch=batch, **extra)

    def publish(self, messages: Sequence[Message]) -> None:
        self.topic.publish([(None, m.body, self._headers(m.key, m.type)) for m in messages])

    @staticmethod
    def _headers(key: str | bytes | None, type_: str) -> list[tuple[str, bytes]]:
        headers = [("type", type_.encode()), ("content-type", b"application/json")]
        if key is not None:
            headers.append(("message-id", key if isinstance(key, bytes) else key.encode()))
        return headers

    def publish_malformed(self) -> None:
        self.topic.publish([(None, b'{"n": -1}', self._headers(b"m-\xff", "order"))])

    def taken(self) -> int:
        # A record consumed is not seen from outside before its commit: what
        # was published is what the consumer, subscribed, takes at once.
        return self.topic.published

    def unsettled(self) -> int:
        return self.topic.lag()

    def left_after_stop(self) -> int:
        return self.topic.lag()

    def drained(self) -> bool:
        return self.topic.lag() == 0

    def dead_letters(self) -> list[DeadLetter]:
        out = []
        for record in self.topic.read_all(self.topic.dead):
            headers = dict(record.headers() or [])
            key = headers.get("message-id")
            reason = headers.get("__connect.errors.exception.class.name")
            out.append(
                DeadLetter(
                    key.decode(errors="replace") if key is not None else None,
                    record.value(),
                    reason.decode() if reason is not None else None,
                )
            )
        return out


KEY_ATTRIBUTE = "message-id"


class Sqs(BrokerUnderTest):
    """A queue and its dead-letter queue on moto; keys in a ``message-id`` message attribute.

    moto counts a queue's messages exactly: what is visible, and what is in
    flight (received, neither deleted nor back yet).
    """

    name = "sqs"
    batches_held = 2  # one storing, one received

    def __init__(self, queue: SqsQueue) -> None:
        self.queue = queue

    def source(self, batch: int, **extra: Any) -> dict[str, Any]:
        return sqs_source(self.queue, batch=batch, **extra)

    def publish(self, messages: Sequence[Message]) -> None:
        self.queue.send([self._entry(m.key, m.body, m.type) for m in messages])

    @staticmethod
    def _entry(key: str | bytes | None, body: bytes, type_: str) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "type": {"DataType": "String", "StringValue": type_},
            "content-type": {"DataType": "String", "StringValue": "application/json"},
        }
        if isinstance(key, bytes):
            attributes[KEY_ATTRIBUTE] = {"DataType": "Binary", "BinaryValue": key}
        elif key is not None:
            attributes[KEY_ATTRIBUTE] = {"DataType": "String", "StringValue": key}
        return {"MessageBody": body.decode(), "MessageAttributes": attributes}

    def publish_malformed(self) -> None:
        # A Binary attribute that is not UTF-8: never decoded with replacements.
        self.queue.send([self._entry(b"m-\xff", b'{"n": -1}', "order")])

    def expect_consumer_kill(self) -> None:
        # What a killed consumer held comes back after 3 s rather than 30.
        self.queue.set_visibility(3)

    def taken(self) -> int:
        return self.queue.published - self.queue.counts()[0]

    def unsettled(self) -> int:
        return sum(self.queue.counts())

    def left_after_stop(self) -> int:
        return sum(self.queue.counts())

    def drained(self) -> bool:
        return self.queue.counts() == (0, 0)

    def dead_letters(self) -> list[DeadLetter]:
        out = []
        for message in self.queue.receive_all(self.queue.dead_url):
            attributes = message.get("MessageAttributes") or {}
            key = attributes.get(KEY_ATTRIBUTE, {})
            reason = attributes.get("dead-letter-reason", {}).get("StringValue")
            shown = key.get("StringValue")
            if shown is None and "BinaryValue" in key:
                shown = bytes(key["BinaryValue"]).decode(errors="replace")
            out.append(DeadLetter(shown, message["Body"].encode(), reason))
        return out


class PubSub(BrokerUnderTest):
    """A topic and subscription on the Pub/Sub emulator; keys in a ``message-id`` attribute.

    What is unacknowledged is counted through a mirror subscription sought
    to a snapshot of the subscription's (cloud_fixtures.Subscription).
    """

    name = "pubsub"
    batches_held = 2  # one storing, one pulled

    def __init__(self, subscription: Subscription) -> None:
        self.subscription = subscription

    def source(self, batch: int, **extra: Any) -> dict[str, Any]:
        return pubsub_source(self.subscription, batch=batch, **extra)

    def publish(self, messages: Sequence[Message]) -> None:
        self.subscription.publish([(m.body, self._attributes(m.key, m.type)) for m in messages])

    @staticmethod
    def _attributes(key: str | None, type_: str) -> dict[str, str]:
        attributes = {"type": type_, "content-type": "application/json"}
        if key is not None:
            attributes[KEY_ATTRIBUTE] = key
        return attributes

    def publish_malformed(self) -> None:
        # Pub/Sub's attributes are UTF-8 always; a NUL no database text holds.
        self.subscription.publish([(b'{"n": -1}', self._attributes("m-\x00", "order"))])

    def taken(self) -> int:
        # A pull takes what the subscription has at once: nothing tells, from
        # outside, what was pulled from what was not.
        return self.subscription.published

    def unsettled(self) -> int:
        return self.subscription.unacknowledged()

    def left_after_stop(self) -> int:
        return self.subscription.unacknowledged()

    def drained(self) -> bool:
        return self.subscription.unacknowledged() == 0

    def dead_letters(self) -> list[DeadLetter]:
        return [
            DeadLetter(
                m.attributes.get(KEY_ATTRIBUTE), m.data, m.attributes.get("dead-letter-reason")
            )
            for m in self.subscription.dead_letters()
        ]


# Every broker the contract suite runs against: (its name, the fixture it is built on, its class).
BROKERS: list[tuple[str, str, type[BrokerUnderTest]]] = [
    ("rabbitmq", "amqp_queue", RabbitMQ),
    ("nats", "jetstream", NatsJetStream),
    ("kafka", "kafka_topic", Kafka),
    ("redis", "redis_stream", RedisStreams),
    ("mqtt", "mqtt_topics", Mqtt),
    ("sqs", "sqs_queue", Sqs),
    ("pubsub", "pubsub_subscription", PubSub),
]


def broker_under_test(request: pytest.FixtureRequest) -> BrokerUnderTest:
    """The broker a contract test is parametrised with, on its own fresh queue or stream."""
    for name, fixture, cls in BROKERS:
        if name == request.param:
            return cls(request.getfixturevalue(fixture))  # type: ignore[call-arg]
    raise LookupError(request.param)
