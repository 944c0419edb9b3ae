"""Claiming under a lease, fencing by token, takeover after expiry, requeue, discard."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import text

from webhook_receiver.database import unit_of_work
from webhook_receiver.extensions import db
from webhook_receiver.outbox import deliveries

from .conftest import config_with, delivery, forward, store_event

LEASE = timedelta(seconds=10)


def claim_next(now: datetime, lease: timedelta) -> deliveries.Claim | None:
    """Claim as the worker does: the claim is its own unit of work."""
    with unit_of_work():
        return deliveries.claim_next(now, lease)


def _app(make_app):
    return make_app(config_with([forward("billing", "http://127.0.0.1:9/b")]))


def test_claim_takes_the_due_delivery_under_a_lease(make_app, clock):
    app = _app(make_app)
    event_id = store_event(app, clock, dedup_key="evt-1")
    with app.app_context():
        claim = claim_next(clock(), LEASE)
        assert claim is not None
        assert (claim.event_id, claim.consumer, claim.kind, claim.attempt) == (
            event_id,
            "billing",
            "forward",
            1,
        )
        assert claim_next(clock(), LEASE) is None
    row = delivery(app, event_id, "billing")
    assert row["state"] == "in_progress"
    assert row["lease_token"] == claim.token
    assert row["lease_expires_at"] == clock() + LEASE
    assert row["attempts"] == 1


def test_nothing_is_claimed_before_next_attempt_at(make_app, clock):
    app = _app(make_app)
    store_event(app, clock, dedup_key="evt-1")
    with app.app_context():
        assert claim_next(clock() - timedelta(seconds=1), LEASE) is None
        assert claim_next(clock(), LEASE) is not None


def test_expired_lease_is_taken_over_and_the_old_holder_is_fenced_off(make_app, clock):
    app = _app(make_app)
    event_id = store_event(app, clock, dedup_key="evt-1")
    with app.app_context():
        first = claim_next(clock(), LEASE)
        assert claim_next(clock() + LEASE - timedelta(seconds=1), LEASE) is None
        second = claim_next(clock() + LEASE, LEASE)
        assert second is not None
        assert second.id == first.id
        assert second.token != first.token
        assert second.attempt == 2
        assert deliveries.mark_delivered(first, clock(), 200) is False
        assert deliveries.mark_delivered(second, clock(), 201) is True
        db.session.commit()
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["response_status"], row["lease_token"]) == ("delivered", 201, None)


def test_claims_go_most_overdue_first(make_app, clock):
    app = _app(make_app)
    first = store_event(app, clock, dedup_key="evt-1")
    clock.advance(1)
    second = store_event(app, clock, dedup_key="evt-2")
    with app.app_context():
        assert claim_next(clock(), LEASE).event_id == first
        assert claim_next(clock(), LEASE).event_id == second


def test_requeue_puts_a_dead_delivery_back_with_a_whole_budget(make_app, clock):
    app = _app(make_app)
    event_id = store_event(app, clock, dedup_key="evt-1")
    with app.app_context():
        claim = claim_next(clock(), LEASE)
        assert deliveries.finish(claim, clock(), deliveries.dead_values(clock(), "HTTP 400", 400))
        db.session.commit()
        assert claim_next(clock(), LEASE) is None
        clock.advance(60)
        assert deliveries.requeue([claim.id], clock()) == 1
        db.session.commit()
        again = claim_next(clock(), LEASE)
    assert again.id == claim.id
    assert again.attempt == 1
    assert delivery(app, event_id, "billing")["state"] == "in_progress"


def test_requeue_leaves_delivered_ones_alone(make_app, clock):
    app = _app(make_app)
    event_id = store_event(app, clock, dedup_key="evt-1")
    with app.app_context():
        claim = claim_next(clock(), LEASE)
        deliveries.mark_delivered(claim, clock(), 200)
        db.session.commit()
        assert deliveries.requeue([claim.id], clock()) == 0
        db.session.commit()
    assert delivery(app, event_id, "billing")["state"] == "delivered"


def test_requeue_leaves_a_delivery_a_worker_has_just_claimed(make_app, clock):
    """The operator saw it stuck; a worker claimed it since: the requeue must not undo that."""
    app = _app(make_app)
    event_id = store_event(app, clock, dedup_key="evt-1")
    with app.app_context():
        stuck = claim_next(clock(), LEASE)
        clock.advance(LEASE.total_seconds() + 1)  # the first holder died
        fresh = claim_next(clock(), LEASE)  # taken over in the meantime
        assert fresh.id == stuck.id
        assert deliveries.requeue([stuck.id], clock()) == 0
        db.session.commit()
        assert deliveries.mark_delivered(fresh, clock(), 200)
        db.session.commit()
    assert delivery(app, event_id, "billing")["state"] == "delivered"


def test_a_discarded_delivery_is_never_claimed_again(make_app, clock):
    app = _app(make_app)
    event_id = store_event(app, clock, dedup_key="evt-1")
    with app.app_context():
        claim = claim_next(clock(), LEASE)
        assert deliveries.finish(
            claim, clock(), deliveries.dead_values(clock(), "consumer 'billing' is gone", None)
        )
        db.session.commit()
        clock.advance(60)
        discarded = deliveries.discard([claim.id], clock())
        db.session.commit()
        assert [(d.id, d.event_id, d.consumer, d.source) for d in discarded] == [
            (claim.id, event_id, "billing", "shop")
        ]
        # Neither a later claim nor a requeue brings it back.
        assert claim_next(clock() + timedelta(days=365), LEASE) is None
        assert deliveries.requeue([claim.id], clock()) == 0
        db.session.commit()
        assert claim_next(clock() + timedelta(days=365), LEASE) is None
    row = delivery(app, event_id, "billing")
    assert row["state"] == "discarded"
    assert row["last_error"] == "consumer 'billing' is gone"
    assert row["attempts"] == 1
    assert row["completed_at"] == row["updated_at"] == clock()


def test_discard_moves_dead_ones_only(make_app, clock):
    """Pending, claimed and delivered deliveries are left alone, in the UPDATE itself."""
    app = _app(make_app)
    pending_id = store_event(app, clock, dedup_key="evt-1")
    claimed_id = store_event(app, clock, dedup_key="evt-2")
    delivered_id = store_event(app, clock, dedup_key="evt-3")
    with app.app_context():
        first = claim_next(clock(), LEASE)
        second = claim_next(clock(), LEASE)
        assert (first.event_id, second.event_id) == (pending_id, claimed_id)
        # The first goes back to pending after a failure, the third is delivered.
        retry = deliveries.retry_values(clock() + timedelta(minutes=1), "HTTP 503", 503)
        deliveries.finish(first, clock(), retry)
        third = claim_next(clock(), LEASE)
        deliveries.mark_delivered(third, clock(), 200)
        db.session.commit()
        assert deliveries.discard([first.id, second.id, third.id], clock()) == []
        db.session.commit()
        # The worker that holds the second one can still finish it.
        assert deliveries.mark_delivered(second, clock(), 200)
        db.session.commit()
    assert [
        delivery(app, e, "billing")["state"] for e in (pending_id, claimed_id, delivered_id)
    ] == [
        "pending",
        "delivered",
        "delivered",
    ]


def test_a_claims_commit_does_not_wait_for_the_disk_where_a_transaction_can_say_so(make_app, clock):
    # Lost in a crash, a claim only makes its delivery claimable again; the
    # setting comes with the claim's own statement, not a round trip of its own.
    app = _app(make_app)
    store_event(app, clock, dedup_key="evt-1")
    with app.app_context():
        if db.engine.dialect.name != "postgresql":
            pytest.skip("SQLite's safety level is the connection's, not a transaction's")
        try:
            assert deliveries.claim_next(clock(), LEASE) is not None
            setting = db.session.execute(text("SHOW synchronous_commit")).scalar()
        finally:
            db.session.rollback()
        assert setting == "off"
        assert db.session.execute(text("SHOW synchronous_commit")).scalar() == "on"
