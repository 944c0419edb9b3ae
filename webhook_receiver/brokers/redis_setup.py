"""``flask brokers declare`` and ``publish`` for a Redis Streams source.

``declare`` creates the source's consumer group, reading from the stream's
first entry, and the stream with it when absent (``XGROUP CREATE ...
MKSTREAM``); the dead-letter stream is made by its first entry. ``publish``
adds one entry (``XADD``) whose fields carry the key and type where the
source's specs read them, the body in ``body_field``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
import redis
import redis.exceptions

from ..config import BrokerSourceConfig

_ERRORS = (redis.exceptions.RedisError, OSError)


def _fail(source: BrokerSourceConfig, problem: str) -> click.ClickException:
    return click.ClickException(f"source {source.name}: {problem}")


def _client(source: BrokerSourceConfig) -> Any:
    client = redis.Redis.from_url(source.url, socket_connect_timeout=5, socket_timeout=10)
    try:
        client.ping()
    except _ERRORS as exc:
        raise _fail(source, f"cannot reach Redis at {source.safe_url}: {exc}") from exc
    return client


def declare_redis(source: BrokerSourceConfig, say: Callable[[str], None]) -> None:
    """Create the source's group (and stream); one line for it, one for the dead-letter stream."""
    stream, group = source.stream or "", source.group_id or ""
    client = _client(source)
    try:
        shown = f"group {group!r} of stream {stream!r} (from its first entry)"
        try:
            client.xgroup_create(stream, group, id="0", mkstream=True)
            say(f"{shown}: created")
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise _fail(source, f"{shown}: {exc}") from exc
            say(f"{shown}: exists")
        dead = source.dead_letter_stream
        if dead:
            kind = client.type(dead)
            kind = kind.decode() if isinstance(kind, bytes) else kind
            if kind not in ("none", "stream"):
                # XADD refuses it: the consumer would read its batch again and again.
                raise _fail(
                    source,
                    f"key {dead!r} (dead_letter_stream) holds a {kind}, not a stream: "
                    "no dead letter can be added to it; delete it, or change the "
                    "source's dead_letter_stream",
                )
            state = "exists" if kind == "stream" else "made by its first entry"
            say(f"stream {dead!r} (dead letters): {state}")
    except _ERRORS as exc:
        raise _fail(source, f"Redis at {source.safe_url}: {exc}") from exc
    finally:
        client.close()


def publish_redis(
    source: BrokerSourceConfig,
    body: bytes,
    fields: dict[str, str],
    properties: dict[str, Any],
    content_type: str | None,
    shown: str,
) -> str:
    """Add one entry to the source's stream: the body in body_field, the key and type in fields."""
    if properties:
        raise click.UsageError(
            f"source {source.name} reads its dedup key from the entry id, which Redis assigns: "
            "give no --key"
        )
    if source.body_field is None:
        raise click.UsageError(
            f'source {source.name} reads the whole entry as the body (body_field = ""): '
            "add the entry with XADD"
        )
    entry: dict[str, str | bytes] = {**fields}
    if content_type and "content_type" not in entry:
        entry["content_type"] = content_type
    entry[source.body_field] = body
    client = _client(source)
    try:
        entry_id = client.xadd(source.stream or "", entry)  # type: ignore[arg-type]
    except _ERRORS as exc:
        raise _fail(source, f"Redis at {source.safe_url}: {exc}") from exc
    finally:
        client.close()
    return f"added to stream {source.stream!r} as entry {entry_id.decode()}: {shown}"
