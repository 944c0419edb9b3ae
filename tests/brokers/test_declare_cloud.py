"""``flask brokers declare`` and ``publish`` for Pub/Sub and SQS: what an operator meets."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import google.api_core.exceptions as api_exceptions
import pytest
from google.cloud import pubsub_v1

from .cloud_fixtures import PROJECT, SqsQueue, sqs_source

SOURCE = "jobs"


def _one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.mark.parametrize("command", [("declare",), ("publish", SOURCE, "{}")])
def test_pubsub_without_credentials_is_one_line(make_app, tmp_path, monkeypatch, command):
    # No emulator, and Google's client finds no credentials: the real
    # client, as an operator without `gcloud auth application-default login` meets it.
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    table = {"provider": "pubsub", "project": "my-project", "subscription": "jobs-receiver"}
    app = make_app({"sources": {SOURCE: table}})
    result = app.test_cli_runner().invoke(args=["brokers", *command])
    error = _one_line_error(result)
    assert error.startswith(f"Error: source {SOURCE}: Pub/Sub: no credentials: ")
    assert "missing.json was not found" in error


# -- Pub/Sub: what exists already --------------------------------------------------


@pytest.fixture
def pubsub_names(pubsub_host) -> Iterator[PubsubNames]:
    names = PubsubNames(f"wr-declare-{uuid.uuid4().hex[:10]}")
    yield names
    names.delete()


@dataclass
class PubsubNames:
    """A test's subscription and dead-letter topic names; everything under them deleted after."""

    name: str

    def topic(self, suffix: str = "") -> str:
        return f"projects/{PROJECT}/topics/{self.name}{suffix}"

    def subscription(self, suffix: str = "") -> str:
        return f"projects/{PROJECT}/subscriptions/{self.name}{suffix}"

    def source(self) -> dict[str, Any]:
        return {
            "provider": "pubsub",
            "project": PROJECT,
            "subscription": self.name,
            "dead_letter_topic": f"{self.name}.dead",
        }

    def delete(self) -> None:
        publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        try:
            for suffix in ("", ".dead", ".other"):
                try:
                    subscriber.delete_subscription(subscription=self.subscription(suffix))
                except api_exceptions.NotFound:
                    pass
                try:
                    publisher.delete_topic(topic=self.topic(suffix))
                except api_exceptions.NotFound:
                    pass
        finally:
            subscriber.close()


def test_pubsub_declare_twice_says_exists(make_app, pubsub_names):
    app = make_app({"sources": {SOURCE: pubsub_names.source()}})
    first = app.test_cli_runner().invoke(args=["brokers", "declare"])
    assert first.exit_code == 0, first.output
    assert [line.rsplit(": ", 1)[1] for line in first.output.splitlines()] == ["created"] * 4
    again = app.test_cli_runner().invoke(args=["brokers", "declare"])
    assert again.exit_code == 0, again.output
    assert [line.rsplit(": ", 1)[1] for line in again.output.splitlines()] == ["exists"] * 3


def test_a_dead_letter_subscription_on_another_topic_is_named(make_app, pubsub_names):
    # The subscription that should keep the dead letters reads another topic:
    # they would be published to a topic nothing keeps, and lost.
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    try:
        publisher.create_topic(name=pubsub_names.topic(".other"))
        subscriber.create_subscription(
            name=pubsub_names.subscription(".dead"), topic=pubsub_names.topic(".other")
        )
    finally:
        subscriber.close()
    app = make_app({"sources": {SOURCE: pubsub_names.source()}})
    error = _one_line_error(app.test_cli_runner().invoke(args=["brokers", "declare"]))
    assert error == (
        f"Error: source {SOURCE}: subscription {pubsub_names.subscription('.dead')!r} "
        f"exists on topic {pubsub_names.topic('.other')!r}, not "
        f"{pubsub_names.topic('.dead')!r}: delete it, or change the source's dead_letter_topic"
    )


def test_a_subscription_whose_topic_was_deleted_is_named(make_app, pubsub_names):
    # Nothing reaches it any more: declare must not call it fine.
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    try:
        publisher.create_topic(name=pubsub_names.topic())
        subscriber.create_subscription(name=pubsub_names.subscription(), topic=pubsub_names.topic())
        publisher.delete_topic(topic=pubsub_names.topic())
    finally:
        subscriber.close()
    table = {**pubsub_names.source(), "dead_letter_topic": None}
    app = make_app({"sources": {SOURCE: {k: v for k, v in table.items() if v}}})
    error = _one_line_error(app.test_cli_runner().invoke(args=["brokers", "declare"]))
    assert error == (
        f"Error: source {SOURCE}: subscription {pubsub_names.subscription()!r} exists, "
        "but its topic was deleted: nothing reaches it; delete the subscription and "
        "declare again"
    )


# -- SQS: what exists already -------------------------------------------------------


def test_sqs_declare_twice_says_exists(make_app, sqs_endpoint):
    queue = SqsQueue(sqs_endpoint, f"wr-declare-{uuid.uuid4().hex[:10]}")
    try:
        fifo = {"FifoQueue": "true"}
        sqs = queue.client()
        # The URLs the source names: moto's, for queues not made yet.
        queue.url = sqs.create_queue(QueueName=f"{queue.name}.fifo", Attributes=fifo)["QueueUrl"]
        queue.dead_url = sqs.create_queue(QueueName=f"{queue.name}-dead.fifo", Attributes=fifo)[
            "QueueUrl"
        ]
        queue.delete()
        table = {**sqs_source(queue), "dedup_key": "deduplication_id"}
        app = make_app({"sources": {SOURCE: table}})
        expected = [
            f"{SOURCE}: queue {queue.name + '-dead.fifo'!r} (FIFO): {{}}",
            f"{SOURCE}: queue {queue.name + '.fifo'!r} (FIFO): {{}}",
        ]
        for state in ("created", "exists"):
            result = app.test_cli_runner().invoke(args=["brokers", "declare"])
            assert result.exit_code == 0, result.output
            assert result.output.splitlines() == [line.format(state) for line in expected]
    finally:
        queue.delete()


def test_a_queue_whose_redrive_policy_counts_receives_is_named(make_app, sqs_queue):
    # declare sets no redrive policy: one made elsewhere moves a message never
    # stored (received once per back-off through a database outage) to its
    # dead-letter queue after maxReceiveCount receives, which declare must say.
    sqs = sqs_queue.client()
    arn = sqs.get_queue_attributes(QueueUrl=sqs_queue.dead_url, AttributeNames=["QueueArn"])[
        "Attributes"
    ]["QueueArn"]
    policy = {"deadLetterTargetArn": arn, "maxReceiveCount": "5"}
    sqs.set_queue_attributes(
        QueueUrl=sqs_queue.url, Attributes={"RedrivePolicy": json.dumps(policy)}
    )
    app = make_app({"sources": {SOURCE: sqs_source(sqs_queue)}})
    result = app.test_cli_runner().invoke(args=["brokers", "declare"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1] == (
        f"{SOURCE}: queue {sqs_queue.name!r}: exists; its redrive policy moves a message "
        f"received 5 times to {sqs_queue.dead!r}, a database outage's receives too: "
        "raise maxReceiveCount far above the outages to ride out"
    )


@pytest.mark.parametrize("command", [("declare",), ("publish", SOURCE, "{}")])
def test_pubsub_away_gives_up_within_the_commands_own_timeout(make_app, monkeypatch, command):
    # Google's default retry of these calls goes on for 60 s; an operator's
    # command says the emulator (or Pub/Sub) is away after its own 10 s.
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "127.0.0.1:1")
    table = {"provider": "pubsub", "project": "my-project", "subscription": "jobs-receiver"}
    app = make_app({"sources": {SOURCE: table}})
    error = _one_line_error(app.test_cli_runner().invoke(args=["brokers", *command]))
    assert error.startswith(f"Error: source {SOURCE}: Pub/Sub: RetryError: Timeout of 10.0s")


def test_a_subscriptions_dead_letter_policy_is_named(make_app, pubsub_names):
    # declare sets none: one made elsewhere counts every delivery, a database
    # outage's too, and moves a message never stored after so many.
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    try:
        publisher.create_topic(name=pubsub_names.topic())
        publisher.create_topic(name=pubsub_names.topic(".other"))
        policy = {"dead_letter_topic": pubsub_names.topic(".other"), "max_delivery_attempts": 5}
        subscriber.create_subscription(
            request={
                "name": pubsub_names.subscription(),
                "topic": pubsub_names.topic(),
                "dead_letter_policy": policy,
            }
        )
    finally:
        subscriber.close()
    table = {k: v for k, v in pubsub_names.source().items() if k != "dead_letter_topic"}
    app = make_app({"sources": {SOURCE: table}})
    result = app.test_cli_runner().invoke(args=["brokers", "declare"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"{SOURCE}: subscription {pubsub_names.subscription()!r}: exists; its dead-letter "
        f"policy moves a message delivered 5 times to {pubsub_names.topic('.other')!r}, a "
        "database outage's deliveries too: raise max_delivery_attempts (100 at most)"
    ]
