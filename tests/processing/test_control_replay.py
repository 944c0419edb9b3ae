"""Replays take what the operator was shown, no more: the count, and the state filtered on.

Real SQLite and PostgreSQL; the deliveries' state moves between the count
and the replay (or between a batch's read and its write), as a worker or
another operator would move it.
"""

from __future__ import annotations

from collections import Counter

from sqlalchemy import select, update

from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery, Replay
from webhook_receiver.outbox import replays as outbox_replays
from webhook_receiver.outbox.replays import Filter
from webhook_receiver.processing import replay

from .conftest import FAST, config_with, forward
from .test_replay import _store_many


def _app(make_app, downstream):
    return make_app(config_with([forward("billing", downstream.url + "/billing")]), **FAST)


def _set(app, state: str, ids: list[int]) -> None:
    with app.app_context():
        db.session.execute(
            update(Delivery).where(Delivery.id.in_(ids)).values(state=state, attempts=1)
        )
        db.session.commit()


def _ids(app) -> list[int]:
    with app.app_context():
        found = list(db.session.scalars(select(Delivery.id).order_by(Delivery.id)))
        db.session.rollback()
    return found


def _states(app) -> dict[int, tuple[str, int | None]]:
    with app.app_context():
        rows = db.session.execute(
            select(Delivery.id, Delivery.state, Delivery.replay_id).order_by(Delivery.id)
        ).all()
        db.session.rollback()
    return {row.id: (row.state, row.replay_id) for row in rows}


def test_a_replay_takes_no_more_than_the_count_shown(make_app, downstream, clock):
    app = _app(make_app, downstream)
    _store_many(app, clock, 6)
    ids = _ids(app)
    # Three dead, three still retrying, among them (lower ids than the last dead one).
    _set(app, "dead", ids[1::2])
    _set(app, "pending", ids[0::2])
    with app.app_context():
        plan = replay.preview(Filter(consumer="billing", state="dead"))
    assert (plan.count, plan.up_to) == (3, ids[-1])
    # The operator reads "3 deliveries match" and confirms; meanwhile the
    # three retrying ones die too.
    _set(app, "dead", ids[0::2])
    with app.app_context():
        done = replay.run(plan, actor="test", via="cli", rest=0)
    assert (done.matched, done.replayed) == (3, 3)
    replayed = [i for i, (_, replay_id) in _states(app).items() if replay_id == done.replay_id]
    assert len(replayed) == 3
    with app.app_context():
        record = db.session.get(Replay, done.replay_id)
        assert (record.matched, record.replayed) == (3, 3)
        db.session.rollback()


def test_a_delivery_that_left_the_filtered_state_since_the_batch_read_is_left_alone(
    make_app, downstream, clock, monkeypatch
):
    app = _app(make_app, downstream)
    _store_many(app, clock, 4)
    ids = _ids(app)
    _set(app, "dead", ids)
    real_next_ids = outbox_replays.next_ids

    def then_requeued_and_delivered(*args, **kwargs):
        found = real_next_ids(*args, **kwargs)
        # Between the batch's read and its write, another operator requeued
        # one of them and a worker delivered it.
        db.session.rollback()
        _set(app, "delivered", [ids[1]])
        return found

    with app.app_context():
        plan = replay.preview(Filter(consumer="billing", state="dead"))
        assert plan.count == 4
        monkeypatch.setattr(outbox_replays, "next_ids", then_requeued_and_delivered)
        done = replay.run(plan, actor="test", via="cli", rest=0)
    # Sent once already: a replay of dead deliveries does not send it again.
    assert done.replayed == 3
    states = _states(app)
    assert states[ids[1]] == ("delivered", None)
    assert Counter(state for state, _ in states.values()) == {"pending": 3, "delivered": 1}


def test_a_limit_past_32_bits_is_taken_as_no_limit_to_a_small_count(make_app, downstream, clock):
    # The CLI takes --limit up to 2**63 - 1; the record's max_count is a
    # 32-bit column, which PostgreSQL refused with a traceback.
    app = _app(make_app, downstream)
    _store_many(app, clock, 3)
    result = app.test_cli_runner().invoke(
        args=["deliveries", "replay", "--consumer", "billing", "--limit", str(2**40), "--yes"]
    )
    assert result.exit_code == 0, result.output
    assert "queued 3 deliveries again" in result.output
