"""Forwards to Redis Streams (``redis://``, ``rediss://``): an entry added, done on the XADD reply.

The entry's fields: ``message_id`` (the forward's stable key), ``type``
(the event type, when it has one), ``content_type``, ``X-Request-Id`` (the
correlation id), ``X-Webhook-Source``, ``X-Webhook-Event-Id`` and, last,
``body``: what a ``redis`` source reads by default (``dedup_key =
"field:message_id"``, ``body_field = "body"``). A worker killed between the XADD and marking the
delivery done adds the entry again, under the same ``message_id``, which a
consumer deduplicates on. One client (a connection pool) per URL and
process, shared by the worker's threads.
"""

from __future__ import annotations

import threading
from typing import Any

import redis
import redis.exceptions

from ...config import ForwardConfig, redact_url
from .base import BrokerMessage, PublishError

SCHEMES = frozenset({"redis", "rediss"})

_clients: dict[tuple[str, float], Any] = {}
_lock = threading.Lock()


def _client(forward: ForwardConfig) -> Any:
    key = (forward.url, forward.timeout_seconds)
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = redis.Redis.from_url(
                forward.url,
                socket_connect_timeout=forward.timeout_seconds,
                socket_timeout=forward.timeout_seconds,
                client_name="webhook-receiver-forwards",
            )
        return client


def fields(message: BrokerMessage) -> dict[str, str | bytes]:
    """The entry a forward adds for ``message``, the body last."""
    entry: dict[str, str | bytes] = {"message_id": message.message_id}
    if message.event_type:
        entry["type"] = message.event_type
    entry["content_type"] = message.content_type or "application/octet-stream"
    entry["X-Request-Id"] = message.correlation_id
    entry.update(message.headers)
    entry["body"] = message.body
    return entry


def publish(forward: ForwardConfig, message: BrokerMessage) -> None:
    try:
        _client(forward).xadd(forward.stream or "", fields(message))  # type: ignore[arg-type]
    except (redis.exceptions.RedisError, OSError) as exc:
        raise PublishError(f"{type(exc).__name__} on {redact_url(forward.url)}: {exc}") from exc
