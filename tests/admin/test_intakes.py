"""The admin names each message's intake: webhook, API, RabbitMQ or NATS.

Conflicts come from webhooks and broker consumers alike, and a broker
message dead-lettered without being stored (no key, malformed, a consumer
error) is listed among the Rejections, with no address.
"""

from __future__ import annotations

import html
import re

import pytest
from flask import Flask
from flask.testing import FlaskClient

from webhook_receiver import rejections
from webhook_receiver.admin import presenters

from ..conftest import CLIENTS
from .conftest import PASSWORD, conflict, event, login, rejection, text

SOURCES = {
    "orders": {
        "provider": "rabbitmq",
        "url": "amqp://guest:secret-pw@127.0.0.1:5672/%2F",
        "queue": "orders",
    },
    "payments": {"provider": "nats", "url": "nats://127.0.0.1:4222", "stream": "PAYMENTS"},
    "shop": {"provider": "github", "secrets": ["s"]},
}


@pytest.fixture
def admin_app(make_app) -> Flask:
    return make_app({"clients": CLIENTS, "sources": SOURCES}, ADMIN_PASSWORD=PASSWORD)


@pytest.fixture
def admin(admin_app: Flask) -> FlaskClient:
    client = admin_app.test_client()
    assert login(client).status_code == 302
    return client


def cells(page: str, marker: str) -> list[list[str]]:
    """The words of each cell of the table row holding ``marker``."""
    at = page.index(marker)
    row = page[page.rindex("<tr", 0, at) :].split("</tr>", 1)[0]
    found = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
    return [html.unescape(re.sub(r"<[^>]+>", " ", cell)).split() for cell in found]


# -- conflicts ---------------------------------------------------------------


def test_the_conflicts_list_names_each_intake(admin_app, admin):
    made = {
        "RabbitMQ": conflict(
            admin_app, event(admin_app, source="orders", meta={"broker": "rabbitmq"})
        ),
        "NATS": conflict(admin_app, event(admin_app, source="payments", meta={"broker": "nats"})),
        "webhook": conflict(admin_app, event(admin_app, source="shop")),
        "API": conflict(admin_app, event(admin_app, source="api:acme")),
        # A broker source since removed from the config: its event's meta says which.
        "NATS ": conflict(admin_app, event(admin_app, source="gone", meta={"broker": "nats"})),
    }
    page = text(admin.get("/admin/conflicts"))
    assert "Webhook deliveries that reused" not in page
    assert "broker messages (dead-lettered)" in page
    for label, conflict_id in made.items():
        row = cells(page, f'data-conflict-id="{conflict_id}"')
        assert row[2] == [label.strip()], (label, row)


@pytest.mark.parametrize(
    ("source", "meta", "label", "noun"),
    [
        ("orders", {"broker": "rabbitmq"}, "RabbitMQ", "message"),
        ("payments", {"broker": "nats"}, "NATS", "message"),
        ("shop", {}, "webhook", "delivery"),
    ],
)
def test_a_conflict_page_names_its_intake(admin_app, admin, source, meta, label, noun):
    conflict_id = conflict(admin_app, event(admin_app, source=source, meta=meta))
    page = text(admin.get(f"/admin/conflicts/{conflict_id}"))
    assert f'<dd id="intake">{label}</dd>' in page
    assert f"<dt>Conflicting {noun}</dt>" in page
    assert "secret-pw" not in page


def test_intake_names():
    assert presenters.intake("api:acme", {"api:acme": "nats"}) == "API"
    assert presenters.intake("orders", {"orders": "rabbitmq"}, "nats") == "RabbitMQ"
    assert presenters.intake("gone", {}, "nats") == "NATS"
    assert presenters.intake("x", {}, {"not": "a name"}) == "webhook"
    assert presenters.intake("shop", {}) == "webhook"


# -- rejections --------------------------------------------------------------


def test_dead_lettered_broker_messages_are_listed_without_an_address(admin_app, admin):
    # As rejections.record writes them: no address is "" (NULLs never meet in
    # the unique constraint); a row with NULL is shown the same.
    rejection(
        admin_app,
        source="orders",
        reason="dedup-key-missing",
        detail="no dedup key at header:Message-Id",
        remote_addr="",
    )
    rejection(
        admin_app,
        source="payments",
        reason="message-malformed",
        detail="the subject is not UTF-8 text",
        remote_addr=None,
    )
    rejection(admin_app, source="shop", reason="signature", remote_addr="203.0.113.9")
    page = text(admin.get("/admin/rejections"))
    assert "broker messages dead-lettered without being stored" in page
    rows = {
        row[1][0]: row
        for row in (cells(page, f"<td>{source}</td>") for source in ("orders", "payments", "shop"))
    }
    minute, source, intake, reason, count, _last, detail, address = rows["orders"]
    assert (source, intake, count, address) == (["orders"], ["RabbitMQ"], ["1"], ["—"])
    assert reason[0] == "dedup-key-missing" and "dead-lettered" in reason
    assert " ".join(detail) == "no dedup key at header:Message-Id"
    _, _, intake, reason, _, _, detail, address = rows["payments"]
    assert (intake, reason[0], address) == (["NATS"], "message-malformed", ["—"])
    assert " ".join(detail) == "the subject is not UTF-8 text"
    _, _, intake, reason, _, _, _, address = rows["shop"]
    assert (intake, reason[0], address) == (["webhook"], "signature", ["203.0.113.9"])
    # The source filter finds a broker source's rows.
    filtered = text(admin.get("/admin/rejections?source=orders"))
    assert "no dedup key at header:Message-Id" in filtered
    assert "the subject is not UTF-8 text" not in filtered


def test_a_broker_dead_letter_recorded_as_the_consumer_does_is_shown(admin_app, admin):
    with admin_app.app_context():
        rejections.record("orders", "consumer-error", "KeyError: 'x'", None)
        rejections.counter(admin_app).flush()
    page = text(admin.get("/admin/rejections"))
    _, source, intake, reason, count, _, detail, address = cells(page, "<td>orders</td>")
    assert (source, intake, reason[0], count, address) == (
        ["orders"],
        ["RabbitMQ"],
        "consumer-error",
        ["1"],
        ["—"],
    )
    assert " ".join(detail) == "KeyError: 'x'"


def test_a_removed_broker_source_is_known_by_its_reason():
    assert presenters.rejection_intake("gone", "dedup-key-missing", {}) == "broker"
    assert presenters.rejection_intake("gone", "signature", {}) == "webhook"
    assert presenters.rejection_intake("orders", "timestamp", {"orders": "rabbitmq"}) == "RabbitMQ"
