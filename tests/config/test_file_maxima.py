"""A source's, a broker's and a forward's numbers past their largest sensible value are refused.

Before, a huge value loaded and crashed at first use: a retention of
millions of days put flask purge's cutoff before year 1 (OverflowError), a
circuit breaker's cool-down past year 9999 overflowed its retry time in the
worker, a JetStream or Kafka batch past 1,000,000 was refused by the driver
(confluent-kafka's consume()), a claim_idle_seconds past threading's limit
overflowed the consumer's wait.
"""

from __future__ import annotations

import re
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from webhook_receiver.config import ConfigError, load_file, parse
from webhook_receiver.config.brokers import BROKER_MAXIMA
from webhook_receiver.config.forwards import FORWARD_MAXIMA
from webhook_receiver.config.sources import SOURCE_MAXIMA
from webhook_receiver.webhooks.providers import PROVIDERS

SOURCE = (
    '[sources.shop]\nprovider = "github"\nsecrets = ["s3cret-0123456789"]\n'
    "{source_line}\n"
    '[[sources.shop.forward]]\nname = "crm"\nurl = "http://127.0.0.1:9/in"\n'
    "{forward_line}\n"
)


def _load(tmp_path, source_line: str = "", forward_line: str = "") -> Any:
    path = tmp_path / "receiver.toml"
    path.write_text(SOURCE.format(source_line=source_line, forward_line=forward_line))
    return load_file(path, required=True, providers=PROVIDERS)


@pytest.mark.parametrize("key", sorted(SOURCE_MAXIMA))
def test_a_source_number_above_its_maximum_is_refused_naming_it(tmp_path, key):
    largest, why = SOURCE_MAXIMA[key]
    assert _load(tmp_path, f"{key} = {largest}").sources["shop"]
    message = rf"\[sources.shop\] {key} must be from 1 to {largest:,} \({re.escape(why)}\)"
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, f"{key} = {largest + 1}")


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("timeout_seconds = {}", "timeout_seconds"),
        ("max_attempts = {}", "max_attempts"),
        ("concurrency = {}", "concurrency"),
        ("circuit_breaker = {{ failures = {} }}", "circuit_breaker.failures"),
        ("circuit_breaker = {{ cool_down_seconds = {} }}", "circuit_breaker.cool_down_seconds"),
    ],
)
def test_a_forward_number_above_its_maximum_is_refused_naming_it(tmp_path, line, key):
    largest, why = FORWARD_MAXIMA[key]
    assert _load(tmp_path, forward_line=line.format(largest)).sources["shop"]
    with pytest.raises(
        ConfigError,
        match=rf"\[\[sources.shop.forward\]\] crm: {key} must be above 0 and at most "
        rf"{largest:,} \({re.escape(why)}\)",
    ):
        _load(tmp_path, forward_line=line.format(largest + 1))


def test_the_longest_cool_down_still_gives_a_retry_time():
    # What the breaker computes when it opens (processing/limits.py).
    largest, _ = FORWARD_MAXIMA["circuit_breaker.cool_down_seconds"]
    assert datetime.max.replace(tzinfo=UTC) > datetime.now(UTC) + timedelta(seconds=largest)


BROKERS: dict[str, dict[str, Any]] = {
    "redis": {"provider": "redis", "url": "redis://127.0.0.1:6379/0", "stream": "jobs"},
    "rabbitmq": {"provider": "rabbitmq", "url": "amqp://127.0.0.1/", "queue": "orders"},
    "nats": {"provider": "nats", "url": "nats://127.0.0.1:4222", "stream": "PAYMENTS"},
    "kafka": {
        "provider": "kafka",
        "bootstrap_servers": "127.0.0.1:9",
        "topics": ["orders"],
        "dedup_key": "header:message-id",
    },
}
CASES = [
    ("redis", "batch"),
    ("redis", "retention_days"),
    ("redis", "claim_idle_seconds"),
    ("redis", "max_deliveries"),
    ("rabbitmq", "prefetch"),
    ("nats", "batch"),
    ("kafka", "batch"),
    ("kafka", "retention_days"),
]


@pytest.mark.parametrize(("provider", "key"), CASES)
def test_a_broker_number_above_its_maximum_is_refused_naming_it(provider, key):
    largest, why = BROKER_MAXIMA[key]
    table = {**BROKERS[provider], key: largest}
    assert parse({"sources": {"in": table}}, providers=()).brokers["in"]
    message = rf"\[sources.in\] {key} must be from 1 to {largest:,} \({re.escape(why)}\)"
    with pytest.raises(ConfigError, match=message):
        parse({"sources": {"in": {**table, key: largest + 1}}}, providers=())


def test_broker_limits_are_within_what_drivers_and_waits_take():
    # confluent_kafka's consume() takes at most 1,000,000 messages; the Redis
    # consumer waits a third of claim_idle_seconds at a time.
    assert BROKER_MAXIMA["batch"][0] <= 1_000_000
    assert BROKER_MAXIMA["prefetch"][0] <= 1_000_000
    assert BROKER_MAXIMA["claim_idle_seconds"][0] / 3 <= threading.TIMEOUT_MAX
