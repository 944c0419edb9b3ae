"""``flask brokers declare`` for Redis Streams: what exists already under the source's keys."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from .redis_fixtures import GROUP

SOURCE = "jobs"


@pytest.fixture
def stream(redis_url: str) -> Iterator[str]:
    name = f"wr-declare-{uuid.uuid4().hex[:10]}"
    yield name
    redis.Redis.from_url(redis_url).delete(name, f"{name}.dead")


def _app(make_app, redis_url: str, stream: str):
    table = {
        "provider": "redis",
        "url": redis_url,
        "stream": stream,
        "group": GROUP,
        "dead_letter_stream": f"{stream}.dead",
    }
    return make_app({"sources": {SOURCE: table}})


def test_declare_twice_says_exists(make_app, redis_url, stream):
    app = _app(make_app, redis_url, stream)
    first = app.test_cli_runner().invoke(args=["brokers", "declare"])
    assert first.exit_code == 0, first.output
    again = app.test_cli_runner().invoke(args=["brokers", "declare"])
    assert again.exit_code == 0, again.output
    assert again.output.splitlines() == [
        f"{SOURCE}: group {GROUP!r} of stream {stream!r} (from its first entry): exists",
        f"{SOURCE}: stream {stream + '.dead'!r} (dead letters): made by its first entry",
    ]


def test_a_dead_letter_key_that_is_not_a_stream_is_named(make_app, redis_url, stream):
    # The consumer can add no dead letter to it, and reads the batch again
    # and again until the key is a stream or gone: declare must not call it fine.
    redis.Redis.from_url(redis_url).set(f"{stream}.dead", "something else")
    app = _app(make_app, redis_url, stream)
    result = app.test_cli_runner().invoke(args=["brokers", "declare"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert errors == [
        f"Error: source {SOURCE}: key {stream + '.dead'!r} (dead_letter_stream) holds a string, "
        "not a stream: no dead letter can be added to it; delete it, or change the "
        "source's dead_letter_stream"
    ]
