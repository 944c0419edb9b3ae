"""``flask brokers declare`` with several sources: each one is tried, whatever befell the others."""

from __future__ import annotations

import uuid

import redis

from .redis_fixtures import GROUP


def test_a_source_that_fails_leaves_the_others_declared_and_the_exit_status_1(make_app, redis_url):
    stream = f"wr-declare-{uuid.uuid4().hex[:10]}"
    sources = {
        # RabbitMQ that is not there, a Kafka source (never declared here),
        # then a Redis source that can be declared.
        "down": {
            "provider": "rabbitmq",
            "url": "amqp://guest:s3cret@127.0.0.1:1/%2F",
            "queue": "q",
        },
        "logs": {
            "provider": "kafka",
            "bootstrap_servers": "127.0.0.1:9",
            "topics": ["orders"],
            "dedup_key": "header:message-id",
        },
        "jobs": {"provider": "redis", "url": redis_url, "stream": stream, "group": GROUP},
    }
    app = make_app({"sources": sources})
    try:
        result = app.test_cli_runner().invoke(args=["brokers", "declare"])
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        lines = result.output.splitlines()
        errors = [line for line in lines if line.startswith("Error: ")]
        assert len(errors) == 2, result.output
        assert errors[0].startswith("Error: source down: cannot reach RabbitMQ")
        assert "kafka-topics.sh" in errors[1]
        assert "s3cret" not in result.output
        assert (
            f"jobs: group {GROUP!r} of stream {stream!r} (from its first entry): created" in lines
        )
        assert redis.Redis.from_url(redis_url).exists(stream)
    finally:
        redis.Redis.from_url(redis_url).delete(stream)
