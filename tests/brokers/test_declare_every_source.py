"""``flask brokers declare`` with several sources: each one is tried, whatever befell the others."""

from __future__ import annotations

import uuid

import redis

from .redis_fixtures import GROUP

# A Kafka source: never declared here (its topics are made with Kafka's tools).
KAFKA = {
    "provider": "kafka",
    "bootstrap_servers": "127.0.0.1:9",
    "topics": ["orders"],
    "dedup_key": "header:message-id",
}


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
        "logs": KAFKA,
        "jobs": {"provider": "redis", "url": redis_url, "stream": stream, "group": GROUP},
    }
    app = make_app({"sources": sources})
    try:
        result = app.test_cli_runner().invoke(args=["brokers", "declare"])
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        lines = result.output.splitlines()
        errors = [line for line in lines if line.startswith("Error: ")]
        assert len(errors) == 1, result.output
        assert errors[0].startswith("Error: source down: cannot reach RabbitMQ")
        # Asked for every source, a Kafka one is a note, not a failure.
        assert (
            "logs: a kafka source, not declared here: make its topics with Kafka's own tools"
            " (kafka-topics.sh --create)" in lines
        )
        assert "s3cret" not in result.output
        assert (
            f"jobs: group {GROUP!r} of stream {stream!r} (from its first entry): created" in lines
        )
        assert redis.Redis.from_url(redis_url).exists(stream)
    finally:
        redis.Redis.from_url(redis_url).delete(stream)


def test_every_broker_away_is_one_line_each_without_its_password(make_app, monkeypatch):
    # Nothing listens on port 1: each source's failure is its one line.
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "127.0.0.1:1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    sources = {
        "rabbit": {"provider": "rabbitmq", "url": "amqp://u:s3cret@127.0.0.1:1/%2F", "queue": "q"},
        "jet": {"provider": "nats", "url": "nats://u:s3cret@127.0.0.1:1", "stream": "S"},
        "streams": {"provider": "redis", "url": "redis://:s3cret@127.0.0.1:1/0", "stream": "s"},
        "devices": {"provider": "mqtt", "url": "mqtt://u:s3cret@127.0.0.1:1", "topics": ["d/#"]},
        "jobs": {
            "provider": "sqs",
            "queue_url": "http://127.0.0.1:1/000000000000/jobs",
            "region": "eu-west-1",
            "endpoint_url": "http://127.0.0.1:1",
        },
        "pulls": {"provider": "pubsub", "project": "my-project", "subscription": "jobs-receiver"},
    }
    app = make_app({"sources": sources})
    result = app.test_cli_runner().invoke(args=["brokers", "declare"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert "s3cret" not in result.output
    lines = result.output.splitlines()
    assert [line.split(":", 2)[1] for line in lines] == [f" source {name}" for name in sources]


def test_every_source_with_a_kafka_one_among_them_exits_0(make_app, redis_url):
    # A release step running declare for all its sources must not fail on
    # the one broker whose topics are made elsewhere; named, it is an error.
    stream = f"wr-declare-{uuid.uuid4().hex[:10]}"
    sources = {
        "logs": KAFKA,
        "jobs": {"provider": "redis", "url": redis_url, "stream": stream, "group": GROUP},
    }
    app = make_app({"sources": sources})
    try:
        result = app.test_cli_runner().invoke(args=["brokers", "declare"])
        assert result.exit_code == 0, result.output
        assert "logs: a kafka source, not declared here" in result.output
        named = app.test_cli_runner().invoke(args=["brokers", "declare", "logs"])
        assert named.exit_code == 1
        assert "kafka-topics.sh" in named.output
    finally:
        redis.Redis.from_url(redis_url).delete(stream)
