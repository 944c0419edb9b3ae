"""The outbox: a new event's deliveries are written in the event's own transaction."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import insert

from webhook_receiver import inbox
from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery, Event

from ..conftest import bearer
from ..helpers import count
from ..processing.conftest import config_with, delivery_rows, forward, store_event


def test_new_event_gets_one_pending_delivery_per_matching_consumer(make_app, clock):
    app = make_app(
        config_with(
            [
                forward("billing", "http://127.0.0.1:9/billing"),
                forward("refunds", "http://127.0.0.1:9/r", event_types=["order.refunded"]),
            ],
            handlers=True,
        )
    )
    paid = store_event(app, clock, dedup_key="evt-1", event_type="order.paid")
    refunded = store_event(app, clock, dedup_key="evt-2", event_type="order.refunded")
    got = {(r["event_id"], r["consumer"], r["kind"], r["state"]) for r in delivery_rows(app)}
    assert got == {
        (paid, "billing", "forward", "pending"),
        (paid, "ledger", "handler", "pending"),
        (paid, "audit", "handler", "pending"),
        (refunded, "billing", "forward", "pending"),
        (refunded, "refunds", "forward", "pending"),
        (refunded, "audit", "handler", "pending"),
    }
    for row in delivery_rows(app):
        assert row["attempts"] == 0
        assert row["next_attempt_at"] == clock()
        assert row["lease_token"] is None


def test_a_duplicate_event_writes_no_second_delivery(make_app, clock):
    app = make_app(config_with([forward("billing", "http://127.0.0.1:9/b")]))
    first = store_event(app, clock, dedup_key="evt-1")
    with app.app_context():
        again = inbox.receive(
            inbox.Message(
                source="shop",
                dedup_key="evt-1",
                fingerprint="f" * 64,
                body=b"{}",
                event_type="order.paid",
                content_type="application/json",
                received_at=clock(),
            )
        )
    assert again == inbox.Duplicate(first)
    assert len(delivery_rows(app)) == 1


def test_an_event_without_consumers_gets_no_delivery(make_app, clock):
    app = make_app(config_with())
    store_event(app, clock, dedup_key="evt-1")
    assert delivery_rows(app) == []


def test_event_and_deliveries_roll_back_together(make_app, clock):
    app = make_app(config_with([forward("billing", "http://127.0.0.1:9/b")]))
    with app.app_context():
        inbox.add(
            inbox.Message(
                source="shop",
                dedup_key="evt-1",
                fingerprint="f" * 64,
                body=b"{}",
                event_type="order.paid",
                received_at=clock(),
            )
        )
        db.session.rollback()
    assert count(app, Event) == count(app, Delivery) == 0


def test_api_event_is_delivered_to_the_clients_forwards(make_app):
    app = make_app(config_with(client_forwards=[forward("crm", "http://127.0.0.1:9/crm")]))
    response = app.test_client().post(
        "/api/events",
        data=json.dumps({"type": "lead.created", "data": {"id": 7}}),
        content_type="application/json",
        headers={**bearer(), "Idempotency-Key": "k-1"},
    )
    assert response.status_code == 201
    event_id = response.get_json()["id"]
    rows = delivery_rows(app)
    assert [(r["event_id"], r["consumer"], r["kind"]) for r in rows] == [
        (event_id, "crm", "forward")
    ]
    with app.app_context():
        assert db.session.get(Event, event_id).source == "api:acme"


def test_delivery_is_unique_per_event_and_consumer(make_app, clock):
    from sqlalchemy.exc import IntegrityError

    from webhook_receiver.outbox import deliveries

    app = make_app(config_with([forward("billing", "http://127.0.0.1:9/b")]))
    event_id = store_event(app, clock, dedup_key="evt-1")
    with app.app_context():
        with pytest.raises(IntegrityError):
            db.session.execute(
                insert(Delivery),
                [
                    {
                        "event_id": event_id,
                        "consumer": "billing",
                        "kind": "forward",
                        **deliveries.new_delivery_columns(clock()),
                    }
                ],
            )
        db.session.rollback()
    assert [r["state"] for r in delivery_rows(app)] == ["pending"]
