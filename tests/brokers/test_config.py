"""Broker sources and broker/signed forwards in the config file: defaults, refusals, redaction."""

from __future__ import annotations

import pytest

from webhook_receiver import config as cfg
from webhook_receiver.brokers.runner import ADAPTERS
from webhook_receiver.webhooks.providers import PROVIDERS

URL = "amqp://guest:s3cret-pass@127.0.0.1:5672/%2F"


def _parse(**sources):
    return cfg.parse({"sources": sources}, "receiver.toml", providers=PROVIDERS)


def test_every_broker_a_source_may_name_has_a_consumer():
    assert set(ADAPTERS) == cfg.BROKER_PROVIDERS


def test_rabbitmq_source_defaults():
    file = _parse(orders={"provider": "rabbitmq", "url": URL, "queue": "orders"})
    source = file.brokers["orders"]
    assert (source.dedup_key, source.event_type, source.batch) == (
        "property:message_id",
        "property:type",
        200,
    )
    assert "orders" not in file.sources  # no /webhooks/orders endpoint
    assert file.retention_days() == {"orders": 30}


def test_nats_source_defaults():
    table = {"provider": "nats", "url": "nats://127.0.0.1:4222", "stream": "PAYMENTS"}
    source = _parse(payments=table).brokers["payments"]
    assert (source.dedup_key, source.event_type, source.durable) == (
        "header:Nats-Msg-Id",
        "subject",
        "webhook-receiver",
    )


NATS_TOKEN_URL = "nats://s3cret-token@127.0.0.1:4222"


@pytest.mark.parametrize(
    ("secret", "table", "safe_url"),
    [
        (
            "s3cret-pass",
            {
                "provider": "rabbitmq",
                "url": URL,
                "queue": "orders",
                "forward": [{"name": "bus", "url": URL, "routing_key": "x"}],
            },
            "amqp://guest:[redacted]@127.0.0.1:5672/%2F",
        ),
        (
            # nats-py reads a user part without a password as the server's token.
            "s3cret-token",
            {
                "provider": "nats",
                "url": NATS_TOKEN_URL,
                "stream": "PAYMENTS",
                "forward": [{"name": "stream", "url": NATS_TOKEN_URL, "subject": "events.x"}],
            },
            "nats://[redacted]@127.0.0.1:4222",
        ),
    ],
    ids=["amqp password", "nats token"],
)
def test_url_secrets_are_redacted_in_reprs(secret, table, safe_url):
    file = _parse(source=table)
    assert secret not in repr(file.brokers["source"])
    assert secret not in repr(file.forwards["source"])
    assert file.brokers["source"].safe_url == safe_url


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({"provider": "rabbitmq", "url": URL, "queue": "q", "stream": "S"}, r"unknown key\(s\)"),
        ({"provider": "rabbitmq", "url": URL}, "queue must name"),
        ({"provider": "rabbitmq", "url": "nats://x", "queue": "q"}, "url must be a amqp://"),
        ({"provider": "nats", "url": "nats://x"}, "stream must name"),
        ({"provider": "rabbitmq", "url": URL, "queue": "q", "prefetch": 0}, "prefetch must be"),
        (
            {"provider": "rabbitmq", "url": URL, "queue": "q", "dedup_key": "property:timestamp"},
            "changes with each delivery",
        ),
        (
            {
                "provider": "nats",
                "url": "nats://x",
                "stream": "S",
                "dedup_key": "header:Nats-Num-Delivered",
            },  # noqa: E501
            "changes with each delivery",
        ),
        (
            {"provider": "nats", "url": "nats://x", "stream": "S", "event_type": "header:X-Death"},
            "changes with each delivery and cannot be an event type",
        ),
        (
            {"provider": "rabbitmq", "url": URL, "queue": "q", "event_type": "property:timestamp"},
            "changes with each delivery and cannot be an event type",
        ),
        (
            {
                "provider": "nats",
                "url": "nats://x",
                "stream": "S",
                "dedup_key": "property:message_id",
            },  # noqa: E501
            "for RabbitMQ sources",
        ),
        (
            {"provider": "rabbitmq", "url": URL, "queue": "q", "event_type": "subject"},
            "NATS source only",
        ),
        (
            {"provider": "nats", "url": "nats://x", "stream": "S", "dead_letter_subject": "a.*"},
            "without wildcards",
        ),
    ],
)
def test_bad_broker_source_is_refused_naming_file_and_table(table, expected):
    with pytest.raises(cfg.ConfigError, match=expected) as info:
        _parse(orders=table)
    assert str(info.value).startswith("receiver.toml: [sources.orders]")
    assert "s3cret-pass" not in str(info.value)


@pytest.mark.parametrize(
    ("forward", "expected"),
    [
        ({"url": URL}, "routing_key must be"),
        ({"url": URL, "routing_key": "k", "subject": "s"}, r"unknown key\(s\): subject"),
        ({"url": "nats://127.0.0.1:4222"}, "subject must be"),
        ({"url": "nats://127.0.0.1:4222", "subject": "a.>"}, "subject must be"),
        ({"url": URL, "routing_key": "k", "signing_secret": "whsec_AAAA"}, "unknown key"),
        ({"url": "http://127.0.0.1:9/x", "signing_secret": "plain"}, "whsec_<base64>"),
        (
            {"url": "http://127.0.0.1:9/x", "signing_secret": "whsec_QUFB", "signing_secrets": []},
            "not both",
        ),
        ({"url": "ftp://127.0.0.1/x"}, "url must be an http://"),
    ],
)
def test_bad_forward_is_refused(forward, expected):
    table = {
        "provider": "rabbitmq",
        "url": URL,
        "queue": "q",
        "forward": [{"name": "f", **forward}],
    }
    with pytest.raises(cfg.ConfigError, match=expected) as info:
        _parse(orders=table)
    assert "[[sources.orders.forward]] f" in str(info.value)


def test_consume_without_broker_sources_or_with_an_unknown_one_says_so(make_app):
    app = make_app({"sources": {"o": {"provider": "rabbitmq", "url": URL, "queue": "q"}}})
    result = app.test_cli_runner().invoke(args=["consume", "nope"])
    assert result.exit_code == 1
    assert "no broker source named 'nope'" in result.output
    bare = make_app({})
    result = bare.test_cli_runner().invoke(args=["consume"])
    assert result.exit_code == 1
    assert "no broker source" in result.output


def test_consume_list_prints_the_broker_sources(make_app):
    app = make_app({"sources": {"o": {"provider": "rabbitmq", "url": URL, "queue": "q"}}})
    result = app.test_cli_runner().invoke(args=["consume", "--list"])
    assert (result.exit_code, result.output) == (0, "o\n")
    assert make_app({}).test_cli_runner().invoke(args=["consume", "--list"]).output == ""


@pytest.mark.parametrize(
    ("filter_subject", "dead"),
    [
        ("payments.>", "payments.dead"),
        ("payments.*", "payments.dead"),
        ("payments.dead", "payments.dead"),
        ("*.dead", "payments.dead"),
        (">", "dead"),
    ],
)
def test_a_dead_letter_subject_inside_the_filter_subject_is_refused(filter_subject, dead):
    table = {
        "provider": "nats",
        "url": "nats://127.0.0.1:4222",
        "stream": "PAYMENTS",
        "filter_subject": filter_subject,
        "dead_letter_subject": dead,
    }
    with pytest.raises(cfg.ConfigError) as info:
        _parse(payments=table)
    message = str(info.value)
    assert message.startswith("receiver.toml: [sources.payments] dead_letter_subject")
    assert f"{dead!r} is inside filter_subject {filter_subject!r}" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("filter_subject", "dead"),
    [
        ("payments.>", "dead.payments"),
        ("payments.>", "payments"),
        ("payments.*", "payments.dead.letters"),
        ("payments.paid", "payments.dead"),
    ],
)
def test_a_dead_letter_subject_outside_the_filter_subject_is_taken(filter_subject, dead):
    table = {
        "provider": "nats",
        "url": "nats://127.0.0.1:4222",
        "stream": "PAYMENTS",
        "filter_subject": filter_subject,
        "dead_letter_subject": dead,
    }
    source = _parse(payments=table).brokers["payments"]
    assert (source.filter_subject, source.dead_letter_subject) == (filter_subject, dead)


@pytest.mark.parametrize(
    ("pattern", "subject", "covered"),
    [
        ("a.>", "a.b", True),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        ("a.*", "a.b", True),
        ("a.*", "a.b.c", False),
        ("a.*", "a.*", True),
        ("a.*", "a.>", False),
        ("a.>", "a.*.>", True),
        ("a.b", "a.*", False),
        ("a.b", "a.b", True),
        ("a.b", "a.c", False),
        (">", "anything.at.all", True),
        ("*", "a.b", False),
    ],
)
def test_subject_covers_follows_nats_wildcards(pattern, subject, covered):
    assert cfg.subject_covers(pattern, subject) is covered
