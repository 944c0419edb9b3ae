"""Fixtures for the SQS and Pub/Sub tests: moto's server and the Pub/Sub emulator, a queue each.

Both servers are started once per session on free ports (tests/sqs_server.py,
tests/pubsub_emulator.py), and the environment the consumers read is set
for the session: moto's credentials for the standard AWS chain, and
``PUBSUB_EMULATOR_HOST``. Each test creates its own queues, or topic and
subscriptions. A server that cannot start skips its tests, except in CI,
where it fails them.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from ..conftest import CI

# The test queues' visibility timeout (the kill tests shorten it).
VISIBILITY_SECONDS = 30
PROJECT = "wr-test-project"


def _unavailable(what: str, exc: BaseException) -> None:
    message = f"{what} is not reachable: {type(exc).__name__}: {exc}"
    if CI:
        pytest.fail(f"{message} (CI: broker tests must run)")
    pytest.skip(message)


@contextmanager
def _session_env(values: dict[str, str]) -> Iterator[None]:
    # The consumers read these as they would in production: the processes
    # the tests start inherit them (tests/servers.app_env).
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# -- SQS (moto) -------------------------------------------------------------------


@pytest.fixture(scope="session")
def sqs_endpoint() -> Iterator[str]:
    """The test SQS's URL (moto's server, started once), its credentials in the environment."""
    from .. import sqs_server

    try:
        url = sqs_server.endpoint()
        sqs_server.client(url).list_queues()
    except Exception as exc:
        _unavailable("SQS (moto)", exc)
        raise
    with _session_env(sqs_server.CREDENTIALS):
        yield url


@dataclass
class SqsQueue:
    """A test's SQS queue and its dead-letter queue (FIFO ones with ``fifo``)."""

    endpoint: str
    name: str
    fifo: bool = False
    published: int = 0
    url: str = ""
    dead_url: str = ""

    def client(self) -> Any:
        from ..sqs_server import client

        return client(self.endpoint)

    @property
    def dead(self) -> str:
        return f"{self.name}-dead" + (".fifo" if self.fifo else "")

    def create(self, visibility: int = VISIBILITY_SECONDS, **attributes: str) -> None:
        """Create the queue and its dead-letter queue (the source names the latter)."""
        sqs = self.client()
        fifo = {"FifoQueue": "true"} if self.fifo else {}
        self.dead_url = sqs.create_queue(QueueName=self.dead, Attributes=fifo)["QueueUrl"]
        self.url = sqs.create_queue(
            QueueName=self.name + (".fifo" if self.fifo else ""),
            Attributes={"VisibilityTimeout": str(visibility), **fifo, **attributes},
        )["QueueUrl"]

    def delete(self) -> None:
        sqs = self.client()
        for url in (self.url, self.dead_url):
            try:
                sqs.delete_queue(QueueUrl=url)
            except Exception:
                pass

    def set_visibility(self, seconds: int) -> None:
        self.client().set_queue_attributes(
            QueueUrl=self.url, Attributes={"VisibilityTimeout": str(seconds)}
        )

    def send(self, entries: list[dict[str, Any]]) -> None:
        """Send SendMessageBatch entries (Id filled in), 10 at a time; every one must be taken."""
        sqs = self.client()
        for start in range(0, len(entries), 10):
            chunk = [{"Id": str(n), **e} for n, e in enumerate(entries[start : start + 10])]
            response = sqs.send_message_batch(QueueUrl=self.url, Entries=chunk)
            assert not response.get("Failed"), response["Failed"]
        self.published += len(entries)

    def counts(self, url: str | None = None) -> tuple[int, int]:
        """(visible, in flight) messages of the queue."""
        attributes = self.client().get_queue_attributes(
            QueueUrl=url or self.url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return (
            int(attributes["ApproximateNumberOfMessages"]),
            int(attributes["ApproximateNumberOfMessagesNotVisible"]),
        )

    def receive_all(self, url: str) -> list[dict[str, Any]]:
        """Every message of ``url``, received once (hidden for the rest of the test)."""
        sqs = self.client()
        out: list[dict[str, Any]] = []
        while True:
            got = sqs.receive_message(
                QueueUrl=url,
                MaxNumberOfMessages=10,
                VisibilityTimeout=600,
                MessageAttributeNames=["All"],
                MessageSystemAttributeNames=["All"],
            ).get("Messages", [])
            if not got:
                return out
            out += got


@pytest.fixture
def sqs_queue(sqs_endpoint: str) -> Iterator[SqsQueue]:
    """A fresh standard queue with a dead-letter queue, deleted afterwards."""
    queue = SqsQueue(sqs_endpoint, f"wr-test-{uuid.uuid4().hex[:10]}")
    queue.create()
    yield queue
    queue.delete()


def sqs_source(queue: SqsQueue, **extra: Any) -> dict[str, Any]:
    """A broker source table consuming ``queue``, keys in a ``message-id`` attribute."""
    return {
        "provider": "sqs",
        "queue_url": queue.url,
        "region": "eu-west-1",
        "endpoint_url": queue.endpoint,
        "dedup_key": "attribute:message-id",
        "event_type": "attribute:type",
        "dead_letter_queue_url": queue.dead_url,
        **extra,
    }


# -- Pub/Sub (the emulator) ---------------------------------------------------------


@pytest.fixture(scope="session")
def pubsub_host() -> Iterator[str]:
    """The Pub/Sub emulator's ``host:port`` (started once), in ``PUBSUB_EMULATOR_HOST``."""
    from .. import pubsub_emulator

    try:
        host = pubsub_emulator.host()
    except Exception as exc:
        _unavailable("the Pub/Sub emulator", exc)
        raise
    with _session_env({"PUBSUB_EMULATOR_HOST": host}):
        yield host


@dataclass
class Subscription:
    """A test's topic, its subscription, a dead-letter topic, and two subscriptions to read with.

    ``mirror`` (on the same topic) counts what the subscription has not
    acknowledged: a snapshot of the subscription's acknowledgements, the
    mirror sought to it, and what the mirror then delivers counted. The
    emulator has no backlog metric, and a pull from the subscription itself
    would take messages from the consumer under test.
    """

    name: str
    published: int = 0

    @property
    def topic(self) -> str:
        return f"projects/{PROJECT}/topics/{self.name}"

    @property
    def path(self) -> str:
        return f"projects/{PROJECT}/subscriptions/{self.name}"

    @property
    def mirror(self) -> str:
        return f"{self.path}-mirror"

    @property
    def dead_topic(self) -> str:
        return f"{self.topic}-dead"

    @property
    def dead_path(self) -> str:
        return f"{self.path}-dead"

    def create(self, **subscription: Any) -> None:
        """Create the topics and the subscriptions (``subscription``: more of its settings)."""
        from google.cloud import pubsub_v1

        publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        try:
            publisher.create_topic(name=self.topic)
            publisher.create_topic(name=self.dead_topic)
            subscriber.create_subscription(
                request={"name": self.path, "topic": self.topic, **subscription}
            )
            subscriber.create_subscription(name=self.mirror, topic=self.topic)
            subscriber.create_subscription(name=self.dead_path, topic=self.dead_topic)
        finally:
            subscriber.close()

    def delete(self) -> None:
        from google.cloud import pubsub_v1

        publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        try:
            for path in (self.path, self.mirror, self.dead_path):
                try:
                    subscriber.delete_subscription(subscription=path)
                except Exception:
                    pass
            for topic in (self.topic, self.dead_topic):
                try:
                    publisher.delete_topic(topic=topic)
                except Exception:
                    pass
        finally:
            subscriber.close()

    def publish(self, messages: list[tuple[bytes, dict[str, str]]]) -> None:
        """Publish (data, attributes) pairs, waiting for every one's confirmation."""
        from google.cloud import pubsub_v1

        from webhook_receiver.brokers.pubsub import publish_exactly

        publisher = pubsub_v1.PublisherClient()
        for data, attrs in messages:
            publish_exactly(publisher, self.topic, data, attrs, 30)
        publisher.stop()
        self.published += len(messages)

    def unacknowledged(self) -> int:
        """Messages the subscription has not acknowledged, delivered (in hand) or not."""
        from google.cloud import pubsub_v1

        subscriber = pubsub_v1.SubscriberClient()
        snapshot = f"projects/{PROJECT}/snapshots/{self.name}-{uuid.uuid4().hex[:8]}"
        try:
            subscriber.create_snapshot(name=snapshot, subscription=self.path)
            subscriber.seek(request={"subscription": self.mirror, "snapshot": snapshot})
            subscriber.delete_snapshot(snapshot=snapshot)
            return len(self._pull_all(subscriber, self.mirror, acknowledge=False))
        finally:
            subscriber.close()

    def dead_letters(self) -> list[Any]:
        """The messages published to the dead-letter topic (PubsubMessages)."""
        from google.cloud import pubsub_v1

        subscriber = pubsub_v1.SubscriberClient()
        try:
            return [r.message for r in self._pull_all(subscriber, self.dead_path, acknowledge=True)]
        finally:
            subscriber.close()

    def take(self, max_messages: int) -> list[Any]:
        """Pull (and never acknowledge) up to ``max_messages``: a consumer that then dies."""
        from google.cloud import pubsub_v1

        subscriber = pubsub_v1.SubscriberClient()
        try:
            response = subscriber.pull(subscription=self.path, max_messages=max_messages, timeout=5)
            return list(response.received_messages)
        finally:
            subscriber.close()

    @staticmethod
    def _pull_all(subscriber: Any, path: str, *, acknowledge: bool) -> list[Any]:
        seen: dict[str, Any] = {}
        while True:
            # The emulator answers an empty pull at once only when told to; the
            # flag is deprecated for Pub/Sub itself, never for this read.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                response = subscriber.pull(
                    request={"subscription": path, "max_messages": 1000, "return_immediately": True}
                )
            if not response.received_messages:
                return list(seen.values())
            for received in response.received_messages:
                seen.setdefault(received.message.message_id, received)
            if acknowledge:
                subscriber.acknowledge(
                    subscription=path, ack_ids=[r.ack_id for r in response.received_messages]
                )


@pytest.fixture
def pubsub_subscription(pubsub_host: str) -> Iterator[Subscription]:
    """A fresh topic and subscription (10 s ack deadline) with a dead-letter topic."""
    subscription = Subscription(f"wr-test-{uuid.uuid4().hex[:10]}")
    subscription.create()
    yield subscription
    subscription.delete()


def pubsub_source(subscription: Subscription, **extra: Any) -> dict[str, Any]:
    """A broker source table consuming ``subscription``, keys in a ``message-id`` attribute."""
    return {
        "provider": "pubsub",
        "project": PROJECT,
        "subscription": subscription.path,
        "dedup_key": "attribute:message-id",
        "event_type": "attribute:type",
        "dead_letter_topic": subscription.dead_topic,
        **extra,
    }
