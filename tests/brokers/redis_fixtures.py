"""Redis Streams for the broker tests: the real Redis on 127.0.0.1, a stream and group per test.

Each test gets its own stream, with its consumer group created from the
stream's start (as ``brokers declare`` and the consumer do), and a
dead-letter stream; both are deleted afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
GROUP = "webhook-receiver"


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The test Redis's URL, once it has been seen to answer."""
    from .conftest import _unavailable

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except Exception as exc:
        _unavailable("Redis", exc)
    return REDIS_URL


@dataclass
class RedisStream:
    """A test's stream, its consumer group and its dead-letter stream."""

    url: str
    name: str

    @property
    def dead(self) -> str:
        return f"{self.name}.dead"

    def client(self) -> Any:
        return redis.Redis.from_url(self.url)

    def create(self) -> None:
        self.client().xgroup_create(self.name, GROUP, id="0", mkstream=True)

    def delete(self) -> None:
        self.client().delete(self.name, self.dead)

    def publish(self, entries: list[dict[str, str | bytes]]) -> None:
        """XADD each entry (its fields, in order), in one pipeline."""
        pipe = self.client().pipeline(transaction=False)
        for fields in entries:
            pipe.xadd(self.name, fields)  # type: ignore[arg-type]
        pipe.execute()

    def group(self) -> dict[str, Any]:
        """XINFO GROUPS of the group: pending, lag, entries-read..."""
        for info in self.client().xinfo_groups(self.name):
            if info["name"] == GROUP.encode():
                return info  # type: ignore[no-any-return]
        raise LookupError(GROUP)

    def unsettled(self) -> int:
        """Entries not yet delivered (lag) plus those delivered and not acknowledged."""
        info = self.group()
        return int(info["lag"] or 0) + int(info["pending"])

    def dead_letters(self) -> list[dict[bytes, bytes]]:
        """Every entry of the dead-letter stream: its fields."""
        return [fields for _, fields in self.client().xrange(self.dead)]


@pytest.fixture
def redis_stream(redis_url: str) -> Iterator[RedisStream]:
    """A fresh stream with its group (from the start), deleted afterwards with its dead letters."""
    stream = RedisStream(redis_url, f"wr-test-{uuid.uuid4().hex[:10]}")
    stream.create()
    yield stream
    stream.delete()


def redis_source(stream: RedisStream, **extra: Any) -> dict[str, Any]:
    """A broker source table consuming ``stream``: keys in ``message_id``, types in ``type``."""
    return {
        "provider": "redis",
        "url": stream.url,
        "stream": stream.name,
        "group": GROUP,
        "dedup_key": "field:message_id",
        "event_type": "field:type",
        "dead_letter_stream": stream.dead,
        **extra,
    }
