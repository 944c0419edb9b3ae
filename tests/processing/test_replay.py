"""Replays, from the CLI or queued for a worker: one event or many, sent again to a real sink."""

from __future__ import annotations

import json
import threading
from collections import Counter
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from webhook_receiver import inbox
from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery, DeliveryAttempt, Replay
from webhook_receiver.outbox import replays as outbox_replays
from webhook_receiver.outbox.replays import Filter
from webhook_receiver.processing import replay

from ..servers import wait_until
from .conftest import FAST, config_with, delivery, drain, forward, store_event


def _app(make_app, downstream, **overrides):
    forwards = [
        forward("billing", downstream.url + "/billing", concurrency=4),
        forward("audit", downstream.url + "/audit"),
    ]
    return make_app(config_with(forwards), **{**FAST, **overrides})


def cli(app, *args: str, input: str | None = None):
    return app.test_cli_runner().invoke(args=["deliveries", *args], input=input)


def drain_after_replay(app, worker, clock):
    """Drain with the test's clock moved past the replay's (the real one): a replay is due now."""
    clock.advance(60)
    return drain(app, worker)


def keys(downstream, path: str) -> list[str]:
    return [call.headers["Idempotency-Key"] for call in downstream.calls_to(path)]


def replays(app) -> list[Replay]:
    with app.app_context():
        found = list(db.session.scalars(select(Replay).order_by(Replay.id)))
        db.session.expunge_all()
        db.session.rollback()
    return found


def test_a_delivered_event_is_sent_again_with_the_same_key_then_a_new_one(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream)
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    assert drain(app, worker) == ["delivered", "delivered"]
    assert keys(downstream, "/billing") == ["billing:shop:evt-1"]

    result = cli(app, "replay", "--event", str(event_id), "--consumer", "billing")
    assert result.exit_code == 0, result.output
    assert "queued 1 delivery again (billing: 1)" in result.output
    assert "a downstream that deduplicates on it will drop the replay" in result.output
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"], row["completed_at"]) == ("pending", 0, None)
    assert delivery(app, event_id, "audit")["state"] == "delivered"  # not asked for
    assert drain_after_replay(app, worker, clock) == ["delivered"]
    assert keys(downstream, "/billing") == ["billing:shop:evt-1"] * 2
    # The sink applies a key once: the replay with the same key changed nothing there.
    assert downstream.applied.count("billing:shop:evt-1") == 1

    result = cli(app, "replay", "--event", str(event_id), "--consumer", "billing", "--new-key")
    assert result.exit_code == 0, result.output
    assert "each with a new key" in result.output
    assert drain_after_replay(app, worker, clock) == ["delivered"]
    assert keys(downstream, "/billing")[-1] == "billing:shop:evt-1:replay-1"
    assert "billing:shop:evt-1:replay-1" in downstream.applied
    # Its retries keep the new key; the next new key is the next number.
    cli(app, "replay", "--event", str(event_id), "--consumer", "billing", "--new-key")
    drain_after_replay(app, worker, clock)
    assert keys(downstream, "/billing")[-1] == "billing:shop:evt-1:replay-2"
    assert len(downstream.calls_to("/audit")) == 1

    # Every attempt names the replay that queued it; each replay is on record.
    records = replays(app)
    assert [(r.via, r.new_key, r.matched, r.replayed) for r in records] == [
        ("cli", False, 1, 1),
        ("cli", True, 1, 1),
        ("cli", True, 1, 1),
    ]
    assert all("@" in r.actor and r.finished_at is not None for r in records)
    assert records[0].filters == {"event_id": event_id, "consumer": "billing"}
    with app.app_context():
        attempt_replays = db.session.scalars(
            select(DeliveryAttempt.replay_id)
            .where(DeliveryAttempt.delivery_id == row["id"])
            .order_by(DeliveryAttempt.id)
        ).all()
    assert attempt_replays == [None, *(r.id for r in records)]


def test_an_event_is_replayed_to_all_its_consumers_whatever_their_state(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream)
    event_id = store_event(app, clock, dedup_key="evt-1")
    with app.app_context():
        db.session.execute(
            update(Delivery)
            .where(Delivery.consumer == "audit")
            .values(state="discarded", attempts=8, last_error="gave up")
        )
        db.session.commit()
    worker = make_worker(app, clock)
    assert drain(app, worker) == ["delivered"]  # billing; audit was discarded
    result = cli(app, "replay", "--event", str(event_id))
    assert result.exit_code == 0, result.output
    assert "queued 2 deliveries again (audit: 1, billing: 1)" in result.output
    assert drain_after_replay(app, worker, clock) == ["delivered", "delivered"]
    assert len(downstream.calls_to("/billing")) == 2
    assert len(downstream.calls_to("/audit")) == 1


def test_a_delivery_in_a_workers_hands_is_left_alone(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream)
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    with app.app_context():
        claim = worker._claim()
    result = cli(app, "replay", "--event", str(event_id))
    assert result.exit_code == 0, result.output
    assert "queued 1 delivery again" in result.output
    assert "1 delivery left alone: in progress at a worker" in result.output
    held = delivery(app, event_id, claim.consumer)
    assert (held["state"], held["lease_token"]) == ("in_progress", claim.token)


def test_replay_refuses_what_it_cannot_do(make_app, downstream, clock):
    app = _app(make_app, downstream)
    event_id = store_event(app, clock, dedup_key="evt-1")
    result = cli(app, "replay", "--event", "999999")
    assert result.exit_code == 1
    assert "Error: no event 999999" in result.output
    result = cli(app, "replay", "--event", str(event_id), "--consumer", "nobody")
    assert result.exit_code == 1
    assert f"event {event_id} has no delivery to consumer 'nobody'" in result.output
    result = cli(app, "replay", "--event", str(event_id), "--source", "shop", "--dry-run")
    assert result.exit_code == 2
    assert "--event replays one event: --source, --dry-run do not apply" in result.output
    result = cli(app, "replay", "--since", "yesterday", "--dry-run")
    assert result.exit_code == 2
    assert "'yesterday' is not an ISO 8601 date and time" in result.output
    result = cli(app, "replay", "--state", "lost", "--dry-run")
    assert result.exit_code == 2
    result = cli(app, "attempts", "999999")
    assert result.exit_code == 1
    assert "event 999999 has no deliveries" in result.output
    assert replays(app) == []


def _store_many(app, clock, n: int, prefix: str = "bulk") -> list[int]:
    with app.app_context():
        outcome = inbox.receive_many(
            [
                inbox.Message(
                    source="shop",
                    dedup_key=f"{prefix}-{i}",
                    fingerprint="f" * 64,
                    body=json.dumps({"type": "order.paid", "data": {"i": i}}).encode(),
                    event_type="order.paid",
                    content_type="application/json",
                    received_at=clock(),
                )
                for i in range(n)
            ]
        )
    return [o.event_id for o in outcome]


def _set_state(app, state: str, **where) -> None:
    conditions = [getattr(Delivery, name) == value for name, value in where.items()]
    with app.app_context():
        db.session.execute(
            update(Delivery).where(*conditions).values(state=state, attempts=1, completed_at=None)
        )
        db.session.commit()


def test_a_bulk_replay_by_filter_sends_each_of_1000_once_more(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream, WORKER_THREADS=4)
    _store_many(app, clock, 1000)
    # As if the worker had delivered them all, and given up on a few of billing's.
    _set_state(app, "delivered")
    with app.app_context():
        dead = db.session.scalars(
            select(Delivery.id).where(Delivery.consumer == "billing").order_by(Delivery.id).limit(7)
        ).all()
    _set_state(app, "dead", consumer="billing")
    _set_state(app, "delivered", consumer="billing")
    with app.app_context():
        db.session.execute(update(Delivery).where(Delivery.id.in_(dead)).values(state="dead"))
        db.session.commit()

    flt = ["--consumer", "billing", "--source", "shop", "--type", "order.paid"]
    result = cli(app, "replay", *flt, "--state", "delivered", "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.output == "993 deliveries match\n"
    assert replays(app) == []

    result = cli(app, "replay", *flt, "--state", "delivered", input="n\n")
    assert result.exit_code == 1
    assert "Replay 993 deliveries? [y/N]: n\nAborted!" in result.output
    assert replays(app) == []

    result = cli(app, "replay", *flt, "--state", "delivered", "--yes")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "993 deliveries match"
    assert "queued 993 deliveries again (billing: 993)" in result.output
    [record] = replays(app)
    assert (record.matched, record.replayed, record.new_key) == (993, 993, False)
    assert record.filters == {
        "consumer": "billing",
        "source": "shop",
        "event_type": "order.paid",
        "state": "delivered",
    }

    worker = make_worker(app, clock)
    clock.advance(60)
    with app.app_context():
        done = worker.run(drain=True, handle_signals=False)
    assert done == 993
    sent = Counter(keys(downstream, "/billing"))
    assert len(sent) == 993 and set(sent.values()) == {1}
    assert downstream.calls_to("/audit") == []
    with app.app_context():
        states = Counter(db.session.scalars(select(Delivery.state)).all())
    assert states == {"delivered": 1993, "dead": 7}


def test_a_bulk_replay_stops_at_its_limit_and_at_what_was_counted(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream)
    early = _store_many(app, clock, 30, "early")
    clock.advance(3600)
    _store_many(app, clock, 20, "late")
    _set_state(app, "delivered")
    since = (clock() - timedelta(minutes=30)).isoformat()

    result = cli(app, "replay", "--consumer", "audit", "--since", since, "--dry-run")
    assert result.output == "20 deliveries match\n"
    result = cli(app, "replay", "--consumer", "audit", "--until", since, "--limit", "12", "--yes")
    assert result.exit_code == 0, result.output
    assert "12 deliveries match" in result.output
    assert "queued 12 deliveries again" in result.output
    with app.app_context():
        replayed = db.session.scalars(
            select(Delivery.event_id).where(Delivery.state == "pending").order_by(Delivery.id)
        ).all()
    assert replayed == early[:12]  # the first twelve by id, all audit's

    # A delivery made after the count is not in the replay that follows it.
    with app.app_context():
        plan = replay.preview(Filter(consumer="billing", state="delivered"))
        assert plan.count == 50
    _store_many(app, clock, 5, "after")
    _set_state(app, "delivered")
    with app.app_context():
        done = replay.run(plan, actor="test", via="cli", batch_size=7)
    assert (done.matched, done.replayed) == (50, 50)
    with app.app_context():
        assert replay.preview(Filter(consumer="billing", state="pending")).count == 50


@pytest.mark.parametrize("batch_size", [1, 7, 500])
def test_batches_add_up_to_the_count(make_app, downstream, clock, batch_size):
    app = _app(make_app, downstream)
    _store_many(app, clock, 40)
    with app.app_context():
        plan = replay.preview(Filter(consumer="billing"))
        done = replay.run(plan, actor="test", via="cli", new_key=True, batch_size=batch_size)
        key_replays = Counter(
            db.session.scalars(select(Delivery.key_replay).where(Delivery.consumer == "billing"))
        )
    assert (plan.count, done.replayed) == (40, 40)
    assert key_replays == {1: 40}
    [record] = replays(app)
    assert record.replayed == 40


# -- replays run by workers (the admin's bulk replays) -------------------------


def _delivered(app, clock, n: int) -> None:
    _store_many(app, clock, n)
    _set_state(app, "delivered")


def _queue(app, **kwargs) -> int:
    with app.app_context():
        plan = replay.preview(Filter(consumer="billing"))
        return replay.queue(plan, actor="admin from 127.0.0.1", via="admin", **kwargs)


def _key_replays(app) -> Counter[int]:
    with app.app_context():
        found = Counter(
            db.session.scalars(select(Delivery.key_replay).where(Delivery.consumer == "billing"))
        )
        db.session.rollback()
    return found


def test_a_running_worker_runs_a_queued_replay_in_the_background(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream)
    _delivered(app, clock, 30)
    worker = make_worker(app, clock)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    thread.start()
    try:
        replay_id = _queue(app, new_key=True, rest=0.5)
        assert wait_until(lambda: len(downstream.calls_to("/billing")) == 30, timeout=30)
    finally:
        worker.stop()
        thread.join(30)
    assert not thread.is_alive()
    sent = Counter(keys(downstream, "/billing"))
    assert len(sent) == 30 and set(sent.values()) == {1}
    assert all(key.endswith(":replay-1") for key in sent)
    [record] = replays(app)
    assert (record.id, record.replayed, record.walked) == (replay_id, 30, 30)
    assert record.finished_at is not None and record.lease_token is None


def test_worker_drain_runs_the_queued_replays_first(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream)
    _delivered(app, clock, 12)
    _queue(app)
    with app.app_context():
        assert make_worker(app, clock).run(drain=True, handle_signals=False) == 12
    assert len(downstream.calls_to("/billing")) == 12
    assert replays(app)[0].finished_at is not None


def test_a_replay_whose_process_died_is_resumed_where_it_got_to(
    make_app, downstream, clock, monkeypatch
):
    app = _app(make_app, downstream)
    _store_many(app, clock, 25)
    _set_state(app, "delivered")
    real_next_ids = outbox_replays.next_ids
    calls = []

    def dies_after_two_batches(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise SystemExit("killed")
        return real_next_ids(*args, **kwargs)

    with app.app_context():
        plan = replay.preview(Filter(consumer="billing"))
        monkeypatch.setattr(outbox_replays, "next_ids", dies_after_two_batches)
        with pytest.raises(SystemExit):
            replay.run(plan, actor="cli", via="cli", new_key=True, batch_size=10, clock=clock)
        db.session.rollback()
        monkeypatch.setattr(outbox_replays, "next_ids", real_next_ids)
        runner = replay.Runner(app, threading.Event(), 1.0, clock=clock)
        # Its lease is live: nobody takes it over yet.
        assert not runner.run_once()
        clock.advance(replay.LEASE.total_seconds() + 1)
        assert runner.run_once()
    [record] = replays(app)
    assert (record.matched, record.walked, record.replayed) == (25, 25, 25)
    assert record.finished_at is not None
    assert _key_replays(app) == {1: 25}  # each once: none twice, none left out


def test_a_process_that_lost_its_lease_changes_nothing(make_app, downstream, clock):
    app = _app(make_app, downstream)
    _store_many(app, clock, 8)
    _set_state(app, "delivered")
    with app.app_context():
        plan = replay.preview(Filter(consumer="billing"))
        slow = replay.start(plan, actor="cli", via="cli", new_key=True, clock=clock)
        clock.advance(replay.LEASE.total_seconds() + 1)
        # A worker takes the replay over (its process looked dead) and runs it.
        assert replay.Runner(app, threading.Event(), 1.0, clock=clock).run_once()
        # The first process comes back: its batch rolls back.
        progress = replay.resume(slow, clock=clock)
    assert progress.finished is False and not progress.consumers
    assert _key_replays(app) == {1: 8}
    [record] = replays(app)
    assert (record.walked, record.replayed) == (8, 8)
