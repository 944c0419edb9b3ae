"""Evicting a key: the engine's rule, so the admin and any other caller apply the same one.

A running request's record (in progress under a live lease) is never
evicted: without it the client's retry would run the request a second time
beside the first. Anything else (completed, abandoned, expired) goes.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from webhook_receiver.database import unit_of_work
from webhook_receiver.extensions import db
from webhook_receiver.idempotency.persistence import records
from webhook_receiver.models import IdempotencyRecord, utcnow


def _record(key: str, state: str, **times) -> int:
    now = utcnow()
    row = IdempotencyRecord(
        client="acme",
        key=key,
        fingerprint="f" * 64,
        method="POST",
        path="/api/events",
        state=state,
        created_at=now - timedelta(minutes=5),
        expires_at=times.get("expires_at", now + timedelta(hours=24)),
        lease_expires_at=times.get("lease_expires_at"),
        response_status=201 if state == records.COMPLETED else None,
    )
    with unit_of_work():
        db.session.add(row)
    return row.id


def _evict(record_id: int) -> str:
    with unit_of_work():
        return records.evict(record_id, utcnow())


def test_only_a_running_requests_record_is_kept(app):
    minute = timedelta(minutes=1)
    with app.app_context():
        now = utcnow()
        running = _record("running", records.IN_PROGRESS, lease_expires_at=now + minute)
        abandoned = _record("abandoned", records.IN_PROGRESS, lease_expires_at=now - minute)
        expired_claim = _record(
            "expired-claim",
            records.IN_PROGRESS,
            lease_expires_at=now + minute,
            expires_at=now - minute,
        )
        completed = _record("completed", records.COMPLETED)
        rows = db.session.scalars(select(IdempotencyRecord).order_by(IdempotencyRecord.id)).all()
        # What a page shows as running (no Evict button) is what evict keeps.
        assert [r.id for r in rows if records.is_running(r, utcnow())] == [running]
        assert _evict(running) == records.RUNNING
        assert _evict(abandoned) == records.EVICTED
        assert _evict(expired_claim) == records.EVICTED
        assert _evict(completed) == records.EVICTED
        assert _evict(completed) == records.GONE
        assert db.session.scalars(select(IdempotencyRecord.id)).all() == [running]
