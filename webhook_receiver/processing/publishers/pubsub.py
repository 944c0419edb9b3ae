"""Forwards to Google Cloud Pub/Sub (``pubsub://<project>/<topic>``): done on the publish future.

The message's data is the event's body; its attributes: ``message-id``
(the forward's stable key, what a ``pubsub`` source reads with
``dedup_key = "attribute:message-id"``), ``type`` (the event type),
``content-type``, ``X-Request-Id`` (the correlation id) and the forward's
headers (``X-Webhook-Source``, ``X-Webhook-Event-Id``). An attribute's
value holds 1,024 bytes at most (Pub/Sub refuses the message otherwise):
a stable key longer than that (a long dedup key, percent-encoded when it
is not printable ASCII) is sent as ``sha256:<hex>`` of itself, as stable
across attempts. No ordering key: a
worker killed between the publish and marking the delivery done publishes
again, and the consumer deduplicates on ``message-id``. Credentials are
the application default credentials (``PUBSUB_EMULATOR_HOST`` for the
emulator); one publisher client per process, shared by the worker's
threads.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import google.api_core.exceptions as api_exceptions
import google.api_core.retry as api_retry
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.publisher import exceptions as publisher_exceptions

from ...config import ForwardConfig
from .base import BrokerMessage, PublishError, PublishRefused

SCHEMES = frozenset({"pubsub"})
# The bytes an attribute's value may hold.
MAX_ATTRIBUTE_VALUE = 1024

# The client's own retry of a publish (its defaults: these codes, 0.1 s
# growing fourfold), but for as long as the attempt lasts, not 600 s.
_RETRYABLE = api_retry.if_exception_type(
    api_exceptions.Aborted,
    api_exceptions.Cancelled,
    api_exceptions.DeadlineExceeded,
    api_exceptions.InternalServerError,
    api_exceptions.ResourceExhausted,
    api_exceptions.ServiceUnavailable,
    api_exceptions.Unknown,
)
# How much longer than its timeout an attempt waits for the client's own
# verdict: its clock starts in its thread, a little after ours.
_GRACE = 0.5

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


def attributes(message: BrokerMessage) -> dict[str, str]:
    """The message's attributes; a message id past Pub/Sub's 1,024 bytes as its SHA-256."""
    values = message.attributes()
    key = values["message-id"]
    if len(key.encode("utf-8")) > MAX_ATTRIBUTE_VALUE:
        values["message-id"] = "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()
    return values


def publish(forward: ForwardConfig, message: BrokerMessage) -> None:
    seconds = forward.timeout_seconds
    # The client publishes (and retries) in a thread of its own: bounded by
    # the attempt's timeout, each call and the retries in all, it has given
    # up by the time the attempt fails, rather than sending a copy later.
    retry = api_retry.Retry(predicate=_RETRYABLE, initial=0.1, multiplier=4, timeout=seconds)
    try:
        future = _publisher().publish(
            topic_path(forward), message.body, retry=retry, timeout=seconds, **attributes(message)
        )
        future.result(timeout=seconds + _GRACE)
    except api_exceptions.InvalidArgument as exc:
        # Too large, or attributes Pub/Sub refuses: whatever the attempt.
        raise PublishRefused(f"Pub/Sub refused the message: {exc}") from exc
    except publisher_exceptions.MessageTooLargeError as exc:
        # The client's own check, before anything is sent: past Pub/Sub's 10 MB a request.
        raise PublishRefused(
            f"the message ({len(message.body)} bytes of body) is too large for Pub/Sub: {exc}"
        ) from exc
    except (api_exceptions.RetryError, api_exceptions.DeadlineExceeded, TimeoutError) as exc:
        raise PublishError(
            f"no answer from Pub/Sub within {seconds:g} s: {type(exc).__name__}: {exc}"
        ) from exc
    except api_exceptions.NotFound as exc:
        raise PublishError(f"no topic {topic_path(forward)!r}: {exc}") from exc
    except Exception as exc:  # a publish future raises whatever failed it
        raise PublishError(f"{type(exc).__name__}: {exc}") from exc
