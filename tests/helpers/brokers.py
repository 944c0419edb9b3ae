"""What the tests of several brokers do the same way, each against its own real server.

The message a forward sends and how a source reads it back, the docs'
worked examples run command by command, ``flask brokers publish`` and its
answer for a source never declared, a source table parsed or refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from click.testing import Result
from flask import Flask

from webhook_receiver import config as cfg
from webhook_receiver.processing import publishers
from webhook_receiver.webhooks.providers import PROVIDERS

from ..brokers import cloud_examples
from ..brokers.conftest import consuming, count_events, wait_until
from . import rows

# What a worker forwards to a broker: a source on that broker must read it
# back as the event it was (assert_forwarded).
FORWARDED = publishers.BrokerMessage(
    body=b'{"paid": true}',
    content_type="application/json",
    message_id="bus:stripe:evt_1",
    correlation_id="req-1",
    event_type="invoice.paid",
    headers={"X-Webhook-Source": "stripe", "X-Webhook-Event-Id": "7"},
)


def assert_forwarded(event: Any) -> None:
    """``event`` is FORWARDED: its key, type, body, content type, correlation id and headers."""
    assert (event.dedup_key, event.event_type, event.body) == (
        FORWARDED.message_id,
        FORWARDED.event_type,
        FORWARDED.body,
    )
    assert (event.content_type, event.correlation_id) == ("application/json", "req-1")
    assert dict(event.headers)["X-Webhook-Event-Id"] == "7"


def consume_one(app: Flask, source: str) -> Any:
    """Consume ``source`` until one event is stored; that event."""
    with consuming(app, source):
        assert wait_until(lambda: count_events(app) == 1, 30)
    [event] = rows(app)
    return event


def run_worked_example(
    app: Flask,
    name: str,
    commands: list[tuple[list[str], list[str]]],
    run: Callable[[list[str], list[str]], str | None],
) -> str | None:
    """Run a docs section's commands in order; what the last command ``run`` ran returned.

    ``consume`` runs in a thread until one event is stored; every other
    command through ``run`` (args, the lines the docs show under it).
    """
    printed = None
    for args, expected in commands:
        if args[0] == "consume":
            with consuming(app, name):
                assert wait_until(lambda: count_events(app) == 1, 30)
        else:
            printed = run(args, expected)
    return printed


def run_cloud_example(
    app: Flask, name: str, commands: list[tuple[list[str], list[str]]], swap: dict[str, str]
) -> None:
    """Run an SQS or Pub/Sub section's commands as written: one event, keyed by the id printed."""
    message_id = run_worked_example(
        app, name, commands, lambda args, lines: cloud_examples.run(app, args, lines, swap)
    )
    [event] = rows(app)
    assert (event.dedup_key, event.event_type, event.body) == (
        message_id,
        "job.created",
        b'{"job": 1}',
    )


def publish_order(app: Flask, source: str) -> Result:
    """``flask brokers publish <source> --key k-1 --type order {}``, run with the CLI runner."""
    return app.test_cli_runner().invoke(
        args=["brokers", "publish", source, "--key", "k-1", "--type", "order", "{}"]
    )


def assert_not_declared(result: Result, source: str) -> None:
    """``result`` is one line and exit status 1: what ``source`` names must be declared first."""
    assert result.exit_code == 1
    assert result.output.count("\n") == 1
    declare = f"does not exist: run `flask --app wsgi brokers declare {source}` first"
    assert declare in result.output


def parse_source(**table: Any) -> cfg.FileConfig:
    """A receiver.toml whose one source, ``jobs``, is ``table``, parsed."""
    return cfg.parse({"sources": {"jobs": table}}, "receiver.toml", providers=PROVIDERS)


def assert_source_refused(problem: str, **table: Any) -> None:
    """Source ``jobs`` of ``table`` is refused with a line naming it and ``problem``."""
    with pytest.raises(cfg.ConfigError, match=r"\[sources\.jobs\]") as refused:
        parse_source(**table)
    assert problem in str(refused.value)
