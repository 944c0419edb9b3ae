"""Scoping between tenants: API clients, webhook sources, broker sources and consumers.

An API client never reads, replays or learns of another's events or
Idempotency-Key records; a dedup key is scoped by its source; a forward's
downstream Idempotency-Key by its consumer and its source.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import event as sa_event
from sqlalchemy import select

from webhook_receiver.extensions import db
from webhook_receiver.models import Event, IdempotencyRecord

from .brokers import conftest as broker_fixtures
from .brokers.conftest import consuming, count_events, rabbit_source, wait_until
from .conftest import GLOBEX_TOKEN, bearer
from .helpers import count, post_event, post_webhook, rows
from .helpers import signing as s
from .processing import conftest as processing_fixtures
from .processing.conftest import FAST, config_with, drain, forward, store_event

# The real RabbitMQ's queue and the loopback downstream, as their own tests have them.
rabbit_url = broker_fixtures.rabbit_url
amqp_queue = broker_fixtures.amqp_queue
downstream = processing_fixtures.downstream
clock = processing_fixtures.clock
make_worker = processing_fixtures.make_worker

ACME_ORDER = {"type": "order.created", "data": {"order": "acme-secret-order"}}
GLOBEX_ORDER = {"type": "order.created", "data": {"order": "globex-secret-order"}}
# Headers that differ on every answer whatever it says.
_PER_ANSWER = {"date", "x-request-id", "x-correlation-id", "traceparent"}


def _answer(response: Any) -> tuple[int, dict[str, str], bytes]:
    headers = {k.lower(): v for k, v in response.headers.items() if k.lower() not in _PER_ANSWER}
    return response.status_code, headers, response.get_data()


@contextmanager
def _statements(app: Flask) -> Iterator[list[str]]:
    """The SQL each request in the block runs (the query path, not its timing)."""
    seen: list[str] = []

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    with app.app_context():
        engine = db.engine
    sa_event.listen(engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        sa_event.remove(engine, "before_cursor_execute", note)


# -- GET /api/events/<id> ------------------------------------------------------


@pytest.fixture
def app(make_app: Any) -> Flask:
    return make_app({"clients": config_with()["clients"], "sources": s.SOURCES})


def test_another_clients_event_is_answered_exactly_as_a_missing_one(app, client):
    created = post_event(client, body=ACME_ORDER)
    assert created.status_code == 201
    acme_id = created.get_json()["id"]
    missing = acme_id + 1000
    with _statements(app) as other_sql:
        other = client.get(f"/api/events/{acme_id}", headers=bearer(GLOBEX_TOKEN))
    with _statements(app) as missing_sql:
        absent = client.get(f"/api/events/{missing}", headers=bearer(GLOBEX_TOKEN))
    assert other.status_code == 404
    assert other.mimetype == "application/problem+json"
    assert _answer(other) == _answer(absent)
    # The same statements for both: nothing read for the other's event alone.
    assert other_sql == missing_sql
    text = other.get_data(as_text=True) + json.dumps(dict(other.headers))
    assert "acme" not in text and "order.created" not in text
    # The owner still reads it.
    assert client.get(f"/api/events/{acme_id}", headers=bearer()).status_code == 200


def test_another_clients_event_is_never_read_from_the_database(app, client):
    # Loaded and then refused, its row (its body, up to the body limit, and
    # its duplicates counted) was read for the other client alone: an answer
    # slower for an id that exists than for one that does not.
    created = post_event(client, key="big", body={"type": "t", "data": "x" * 500_000})
    acme_id = created.get_json()["id"]
    loaded: list[int] = []

    def note(target: Event, context: Any) -> None:
        loaded.append(target.id)

    sa_event.listen(Event, "load", note)
    try:
        other = client.get(f"/api/events/{acme_id}", headers=bearer(GLOBEX_TOKEN))
        assert other.status_code == 404
        assert loaded == []
        assert client.get(f"/api/events/{acme_id}", headers=bearer()).status_code == 200
        assert loaded == [acme_id]
    finally:
        sa_event.remove(Event, "load", note)


def test_a_webhook_sources_event_is_answered_as_a_missing_one(app, client):
    body, headers = s.delivery_for("generic-json", "dlv-1")
    assert post_webhook(client, "generic-json", body, headers).status_code in (200, 202)
    [stored] = rows(app)
    other = client.get(f"/api/events/{stored.id}", headers=bearer())
    absent = client.get(f"/api/events/{stored.id + 1000}", headers=bearer())
    assert other.status_code == 404
    assert _answer(other) == _answer(absent)
    assert "generic-json" not in other.get_data(as_text=True)
    assert "dlv-1" not in other.get_data(as_text=True)


# -- one Idempotency-Key, two clients ------------------------------------------


def test_the_same_key_for_two_clients_is_two_records_and_two_events(app, client):
    acme = post_event(client, key="shared", body=ACME_ORDER)
    globex = post_event(client, key="shared", body=ACME_ORDER, token=GLOBEX_TOKEN)
    assert (acme.status_code, globex.status_code) == (201, 201)
    assert "Idempotent-Replayed" not in globex.headers
    acme_doc, globex_doc = acme.get_json(), globex.get_json()
    assert acme_doc["id"] != globex_doc["id"]
    assert (acme_doc["source"], globex_doc["source"]) == ("api:acme", "api:globex")
    # Each retry replays its own client's answer.
    acme_again = post_event(client, key="shared", body=ACME_ORDER)
    globex_again = post_event(client, key="shared", body=ACME_ORDER, token=GLOBEX_TOKEN)
    assert acme_again.headers["Idempotent-Replayed"] == "true"
    assert globex_again.headers["Idempotent-Replayed"] == "true"
    assert acme_again.get_json() == acme_doc
    assert globex_again.get_json() == globex_doc
    assert count(app) == 2
    with app.app_context():
        records = db.session.scalars(select(IdempotencyRecord).order_by(IdempotencyRecord.id))
        assert sorted((r.client, r.key) for r in records) == [
            ("acme", "shared"),
            ("globex", "shared"),
        ]
        events = db.session.scalars(select(Event).order_by(Event.id)).all()
        assert [(e.client, e.meta["idempotency_key"]) for e in events] == [
            ("acme", "shared"),
            ("globex", "shared"),
        ]


def test_a_key_another_client_used_with_another_body_is_no_mismatch(app, client):
    # globex's body under the key neither binds nor replays for acme.
    assert post_event(client, key="k", body=GLOBEX_ORDER, token=GLOBEX_TOKEN).status_code == 201
    acme = post_event(client, key="k", body=ACME_ORDER)
    assert acme.status_code == 201
    assert "Idempotent-Replayed" not in acme.headers
    assert acme.get_json()["data"] == ACME_ORDER["data"]
    # acme's own mismatch is about acme's own record alone.
    mismatch = post_event(client, key="k", body=GLOBEX_ORDER)
    assert mismatch.status_code == 422
    assert mismatch.get_json()["type"] == "/problems/idempotency-key-reused"
    text = mismatch.get_data(as_text=True) + json.dumps(dict(mismatch.headers))
    assert "globex" not in text
    # globex's retry still replays globex's event, untouched by acme's requests.
    again = post_event(client, key="k", body=GLOBEX_ORDER, token=GLOBEX_TOKEN)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_json()["data"] == GLOBEX_ORDER["data"]
    assert count(app) == 2


def test_a_speculative_retry_of_one_client_does_not_replay_the_others(app, client):
    # Past a fifth of retries the engine reads the key first: both ways, scoped.
    for n in range(12):
        post_event(client, key=f"r-{n}", body=GLOBEX_ORDER, token=GLOBEX_TOKEN)
        post_event(client, key=f"r-{n}", body=GLOBEX_ORDER, token=GLOBEX_TOKEN)
    for n in range(12):
        fresh = post_event(client, key=f"r-{n}", body=ACME_ORDER)
        assert fresh.status_code == 201
        assert "Idempotent-Replayed" not in fresh.headers
        assert fresh.get_json()["source"] == "api:acme"
    assert count(app) == 24


def test_nothing_of_another_client_is_logged_at_info_for_the_requester(app, client, caplog):
    created = post_event(client, key="shared-key-77", body=GLOBEX_ORDER, token=GLOBEX_TOKEN)
    globex_id = created.get_json()["id"]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        client.get(f"/api/events/{globex_id}", headers=bearer())
        post_event(client, key="shared-key-77", body=ACME_ORDER)
        post_event(client, key="shared-key-77", body=GLOBEX_ORDER)
    logged = " ".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "globex" not in logged
    assert "globex-secret-order" not in logged


# -- one dedup key, two sources ------------------------------------------------


@pytest.fixture
def two_sources_app(make_app: Any) -> Flask:
    twin = dict(s.SOURCES["generic-json"])
    return make_app({"sources": {**s.SOURCES, "generic-json-2": twin}})


def test_the_same_dedup_key_on_two_webhook_sources_is_two_events(two_sources_app):
    app = two_sources_app
    client = app.test_client()
    for source in ("generic-json", "generic-json-2", "generic-json", "generic-json-2"):
        body, headers = s.delivery_for("generic-json", "dlv-shared")
        assert post_webhook(client, source, body, headers).status_code in (200, 202)
    stored = rows(app)
    assert sorted((e.source, e.dedup_key, e.duplicate_count) for e in stored) == [
        ("generic-json", "dlv-shared", 1),
        ("generic-json-2", "dlv-shared", 1),
    ]


def test_the_same_key_on_a_broker_and_a_webhook_source_is_two_events(make_app, amqp_queue):
    source = rabbit_source(amqp_queue, dedup_key="property:message_id")
    app = make_app({"sources": {**s.SOURCES, "orders": source}})
    body, headers = s.delivery_for("generic-json", "shared-key")
    assert post_webhook(app.test_client(), "generic-json", body, headers).status_code in (200, 202)
    amqp_queue.publish([(b'{"n": 1}', {"message_id": "shared-key", "type": "t"})])
    with consuming(app, "orders"):
        assert wait_until(lambda: count_events(app, "orders") == 1, 30)
    stored = rows(app)
    assert sorted((e.source, e.dedup_key) for e in stored) == [
        ("generic-json", "shared-key"),
        ("orders", "shared-key"),
    ]


# -- a forward's downstream Idempotency-Key ------------------------------------


def _add_billing_source(config: dict[str, Any], name: str, url: str) -> None:
    """Add source ``name`` to ``config``: shop's settings, forwarding to ``url`` as billing."""
    other = dict(config["sources"]["shop"])
    other["forward"] = [forward("billing", url)]
    config["sources"][name] = other


def test_the_downstream_key_differs_per_consumer_and_per_source(
    make_app, downstream, clock, make_worker
):
    config = config_with(
        [forward("billing", downstream.url + "/in"), forward("crm", downstream.url + "/in")]
    )
    _add_billing_source(config, "shop-eu", downstream.url + "/in")
    app = make_app(config, **FAST)
    store_event(app, clock, dedup_key="evt-1", source="shop")
    store_event(app, clock, dedup_key="evt-1", source="shop-eu")
    assert drain(app, make_worker(app, clock)) == ["delivered"] * 3
    keys = [call.headers["Idempotency-Key"] for call in downstream.calls_to("/in")]
    assert sorted(keys) == ["billing:shop-eu:evt-1", "billing:shop:evt-1", "crm:shop:evt-1"]
    # An idempotent downstream applied all three.
    assert len(downstream.applied) == 3


def test_the_downstream_key_differs_for_sources_and_keys_that_hold_colons(
    make_app, downstream, clock, make_worker
):
    # Sources "shop" and "shop:eu" (a legal name), each forwarding to one
    # downstream as "billing": shop's "eu:1" and shop:eu's "1" are two events.
    config = config_with([forward("billing", downstream.url + "/in")])
    _add_billing_source(config, "shop:eu", downstream.url + "/in")
    app = make_app(config, **FAST)
    store_event(app, clock, dedup_key="eu:1", source="shop")
    store_event(app, clock, dedup_key="1", source="shop:eu")
    assert drain(app, make_worker(app, clock)) == ["delivered"] * 2
    keys = [call.headers["Idempotency-Key"] for call in downstream.calls_to("/in")]
    # Both were sent as billing:shop:eu:1: the idempotent downstream applied one.
    assert sorted(keys) == ["billing:shop%3Aeu:1", "billing:shop:eu%3A1"]
    assert len(downstream.applied) == 2


def test_no_dedup_key_takes_the_key_of_another_events_replay_or_api_client():
    # A replay with a new key appends ':replay-<n>'; an event whose own key
    # ends so was sent under the same key as the other's replay.
    from webhook_receiver.config import ConfigError
    from webhook_receiver.config.sources import check_source_name
    from webhook_receiver.processing.stable_keys import dedup_key_of, idempotency_key

    replayed = idempotency_key("billing", "shop", "evt-1", replay=2)
    lookalike = idempotency_key("billing", "shop", "evt-1:replay-2")
    assert replayed == "billing:shop:evt-1:replay-2" != lookalike
    # A source named "api" (refused now) and API client acme: one key once.
    assert idempotency_key("billing", "api:acme", "replay-2") == "billing:api:acme:replay-2"
    with pytest.raises(ConfigError, match="not a usable source name"):
        check_source_name("api", "[sources.api]")
    # Keys with no ':' or '%' are sent as they were; the others read back whole.
    assert idempotency_key("billing", "shop", "evt_1") == "billing:shop:evt_1"
    cases = [("shop:eu", "a:b%3A"), ("shop", "ключ:1"), ("100%", "x"), ("api:a:b", "k:1")]
    for source, key in cases:
        stable = idempotency_key("billing", source, key)
        assert dedup_key_of(stable, "billing", source) == key
