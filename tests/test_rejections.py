"""Refused deliveries: a flood of forgeries is a count per address and minute, in batches."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import select

from webhook_receiver import rejections
from webhook_receiver.extensions import db
from webhook_receiver.models import Rejection

from .helpers import signing as s


@pytest.fixture
def app(make_app: Callable[..., Flask]) -> Flask:
    return make_app({"sources": s.SOURCES})


def _forged(client: FlaskClient, n: int, addr: str = "198.51.100.7") -> int:
    return client.post(
        "/webhooks/stripe-live",
        data=b'{"id":"evt_forged"}',
        headers={"Stripe-Signature": f"t={n},v1={'0' * 64}", "Content-Type": "application/json"},
        environ_base={"REMOTE_ADDR": addr},
    ).status_code


def rejection_rows(app: Flask) -> list[tuple[str, str, str, int]]:
    with app.app_context():
        rows = db.session.execute(
            select(
                Rejection.source, Rejection.reason, Rejection.remote_addr, Rejection.seen_count
            ).order_by(Rejection.remote_addr)
        ).all()
        db.session.rollback()
        return [tuple(row) for row in rows]


def test_a_flood_of_bad_signatures_is_one_counted_row_per_address_and_minute(app: Flask) -> None:
    client = app.test_client()
    statuses = {_forged(client, n) for n in range(300)}
    statuses |= {_forged(client, n, "203.0.113.1") for n in range(20)}
    assert statuses == {401}
    rows = rejection_rows(app)
    # Two addresses: two rows (three if the minute turned meanwhile), 320 refusals.
    assert 2 <= len(rows) <= 4, rows
    assert sum(row[3] for row in rows) == 320
    assert {row[2] for row in rows} == {"198.51.100.7", "203.0.113.1"}


def test_batched_refusals_write_nothing_per_request_then_add_up(make_app) -> None:
    app = make_app({"sources": s.SOURCES}, REJECTION_FLUSH_SECONDS=3600)
    client = app.test_client()
    for n in range(200):
        assert _forged(client, n) == 401
    # Counted in the process; not one write yet, so not one turn at the lock.
    assert rejection_rows(app) == []
    counter = rejections.counter(app)
    assert counter.pending() == 200
    counter.close()
    rows = rejection_rows(app)
    assert sum(row[3] for row in rows) == 200 and len(rows) <= 2
    # Another process's batch (or a later one) adds to the same minute's row.
    for n in range(5):
        assert _forged(client, n) == 401
    counter.flush()
    assert sum(row[3] for row in rejection_rows(app)) == 205
    assert len(rejection_rows(app)) <= 3  # one per minute the test spans
