"""``flask purge`` beside a live intake: a delivery racing the purge of its key's event."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from datetime import timedelta

import pytest
from sqlalchemy import insert, select

from webhook_receiver.extensions import db
from webhook_receiver.inbox import one
from webhook_receiver.models import Event, EventConflict, utcnow
from webhook_receiver.retention import PurgeReport, purge

from .conftest import CLIENTS
from .helpers import event_row
from .helpers.signing import hmac_hex

SECRET = "s" * 16
SHORT = {"provider": "generic", "secrets": [SECRET], "signature_header": "X-Sig"}
CONFIG = {"sources": {"short": {**SHORT, "retention_days": 3}}, "clients": CLIENTS}


@pytest.fixture
def app(make_app):
    return make_app(CONFIG)


def test_a_conflict_whose_event_is_purged_meanwhile_is_stored_as_new(app, client, monkeypatch):
    # Between the intake's read of the key (an old event, other content: a
    # conflict) and its keeping of the conflict, the purge deletes the
    # event. The conflict's row then referred to no event: a 500 (a
    # foreign-key error) on both databases. The key is free by then: the
    # delivery is stored as a new event.
    with app.app_context():
        db.session.execute(
            insert(Event.__table__).values(
                event_row(source="short", dedup_key="k-1", received_at=utcnow() - timedelta(10))
            )
        )
        db.session.commit()
    purged: list[PurgeReport] = []
    real_transaction = one.transaction

    def run_purge() -> None:
        with app.app_context():
            purged.append(purge(utcnow(), 10))

    @contextmanager
    def purge_first(*args, **kwargs):
        # The purge runs, and commits, in the window: after the read, before the write.
        if not purged:
            thread = threading.Thread(target=run_purge)
            thread.start()
            thread.join(30)
        with real_transaction(*args, **kwargs) as conn:
            yield conn

    monkeypatch.setattr(one, "transaction", purge_first)
    body = json.dumps({"other": "content"}).encode()
    response = client.post(
        "/webhooks/short",
        data=body,
        headers={
            "X-Sig": "sha256=" + hmac_hex(body, SECRET),
            "Idempotency-Key": "k-1",
            "Content-Type": "application/json",
        },
    )
    assert purged and purged[0].events == 1
    assert response.status_code == 200, response.get_data(as_text=True)
    with app.app_context():
        # (SQLite may give the new event the purged one's id.)
        stored = db.session.execute(select(Event.id, Event.body)).all()
        assert [tuple(row) for row in stored] == [(response.get_json()["event_id"], body)]
        assert db.session.scalars(select(EventConflict.id)).all() == []
