"""Forwards to message brokers: publish the event instead of POSTing it.

One module per broker (amqp.py, jetstream.py, kafka.py, redis.py, mqtt.py, sqs.py,
pubsub.py), each with its ``SCHEMES`` and its ``publish(forward, message)``;
``publish`` picks the forward's by its URL's scheme. Every publish returns only once the broker
confirmed it (a confirm, a PubAck, a delivery report); anything else is a
``PublishError`` and the delivery is retried, or a ``PublishRefused`` and it
goes dead at once.

The message id (AMQP ``message_id``, NATS ``Nats-Msg-Id``, Kafka's
``message-id`` header) is the forward's stable key,
``<consumer>:<source>:<dedup key>``: a worker killed between the publish and
marking the delivery done publishes the same id again, which the broker
(JetStream's duplicate window) or the consumer deduplicates on.
"""

from __future__ import annotations

from ...config import ForwardConfig
from . import amqp, jetstream, kafka, mqtt, pubsub, redis, sqs
from .base import BrokerMessage, PublishError, PublishRefused

__all__ = [
    "BROKER_SCHEMES",
    "BrokerMessage",
    "PublishError",
    "PublishRefused",
    "close_thread_connections",
    "publish",
]

_BY_SCHEME = {
    scheme: module.publish
    for module in (amqp, jetstream, kafka, redis, mqtt, sqs, pubsub)
    for scheme in module.SCHEMES
}
BROKER_SCHEMES = frozenset(_BY_SCHEME)


def publish(forward: ForwardConfig, message: BrokerMessage) -> None:
    """Publish ``message`` through ``forward``; return once confirmed, else raise PublishError."""
    _BY_SCHEME[forward.scheme](forward, message)


def close_thread_connections() -> None:
    """Close this thread's broker connections (a worker thread stopping: a clean close)."""
    amqp.close_thread_connections()
