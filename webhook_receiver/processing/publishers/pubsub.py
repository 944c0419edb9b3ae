"""Forwards to Google Cloud Pub/Sub (``pubsub://<project>/<topic>``): done on the publish future.

The message's data is the event's body; its attributes: ``message-id``
(the forward's stable key, what a ``pubsub`` source reads with
``dedup_key = "attribute:message-id"``), ``type`` (the event type),
``content-type``, ``X-Request-Id`` (the correlation id) and the forward's
headers (``X-Webhook-Source``, ``X-Webhook-Event-Id``). No ordering key: a
worker killed between the publish and marking the delivery done publishes
again, and the consumer deduplicates on ``message-id``. Credentials are
the application default credentials (``PUBSUB_EMULATOR_HOST`` for the
emulator); one publisher client per process, shared by the worker's
threads.
"""

from __future__ import annotations

import threading
from typing import Any

import google.api_core.exceptions as api_exceptions
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.publisher import exceptions as publisher_exceptions

from ...config import ForwardConfig
from .base import BrokerMessage, PublishError, PublishRefused

SCHEMES = frozenset({"pubsub"})

_clients: list[Any] = []
_lock = threading.Lock()


def topic_path(forward: ForwardConfig) -> str:
    """The topic's full name, from the forward's pubsub://<project>/<topic>."""
    project, _, topic = forward.url.removeprefix("pubsub://").partition("/")
    return f"projects/{project}/topics/{topic}"


def _publisher() -> Any:
    with _lock:
        if not _clients:
            # One message a batch: each publish is sent at once, not after
            # the client's batching latency.
            settings = pubsub_v1.types.BatchSettings(max_messages=1)
            _clients.append(pubsub_v1.PublisherClient(batch_settings=settings))
        return _clients[0]


def publish(forward: ForwardConfig, message: BrokerMessage) -> None:
    try:
        future = _publisher().publish(topic_path(forward), message.body, **message.attributes())
        future.result(timeout=forward.timeout_seconds)
    except api_exceptions.InvalidArgument as exc:
        # Too large, or attributes Pub/Sub refuses: whatever the attempt.
        raise PublishRefused(f"Pub/Sub refused the message: {exc}") from exc
    except publisher_exceptions.MessageTooLargeError as exc:
        # The client's own check, before anything is sent: past Pub/Sub's 10 MB a request.
        raise PublishRefused(
            f"the message ({len(message.body)} bytes of body) is too large for Pub/Sub: {exc}"
        ) from exc
    except api_exceptions.NotFound as exc:
        raise PublishError(f"no topic {topic_path(forward)!r}: {exc}") from exc
    except Exception as exc:  # a publish future raises whatever failed it
        raise PublishError(f"{type(exc).__name__}: {exc}") from exc
