"""Replays take what the operator was shown, no more: the count, and the state filtered on.

Real SQLite and PostgreSQL; the deliveries' state moves between the count
and the replay (or between a batch's read and its write), as a worker or
another operator would move it.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, select, update
from sqlalchemy.engine import make_url

from webhook_receiver import database
from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery, Replay
from webhook_receiver.outbox import replays as outbox_replays
from webhook_receiver.outbox.replays import Filter
from webhook_receiver.processing import replay

from ..test_database_down import cut_off, restore
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


@contextmanager
def _database_away(db_url: str) -> Iterator[Callable[[], None]]:
    """A real outage of this test's database, begun by the callable it yields, ended after."""
    if db_url.startswith("sqlite:///"):
        holder = sqlite3.connect(db_url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            # Another process's write lock, held past the (lowered) busy timeout.
            yield lambda: holder.execute("BEGIN EXCLUSIVE")
        finally:
            holder.close()
        return
    url = make_url(db_url)
    admin = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        yield lambda: cut_off(admin, url.database)
    finally:
        restore(admin, url.database)
        admin.dispose()


def test_a_cli_replay_cut_off_by_an_outage_says_a_worker_resumes_it_and_one_does(
    make_app, downstream, clock, db_url, monkeypatch
):
    # The operator used to get the generic "database cannot be reached" and
    # nothing of the replay already recorded: running it again queued its
    # deliveries twice.
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 300)
    app = _app(make_app, downstream)
    _store_many(app, clock, 5)
    real_requeue = outbox_replays.requeue
    with _database_away(db_url) as away:

        def away_at_the_first_batch(*args, **kwargs):
            away()
            return real_requeue(*args, **kwargs)

        monkeypatch.setattr(outbox_replays, "requeue", away_at_the_first_batch)
        result = app.test_cli_runner().invoke(
            args=["deliveries", "replay", "--consumer", "billing", "--yes"]
        )
    monkeypatch.setattr(outbox_replays, "requeue", real_requeue)
    assert result.exit_code == 1, result.output
    assert "replay 1 stopped part-way: the database cannot be reached" in result.output
    assert "flask worker` resumes it where it stopped" in result.output
    assert "Do not run the command again" in result.output
    assert "Traceback" not in result.output
    with app.app_context():
        db.session.remove()  # the connections the outage ended
        runner = replay.Runner(app, threading.Event(), 1.0, clock=clock)
        assert not runner.run_once()  # its lease is live
        # The CLI leased it on the real clock, some seconds past this test
        # clock's start on a loaded machine: a minute more than the lease.
        clock.advance(replay.LEASE.total_seconds() + 60)
        assert runner.run_once()
    states = _states(app)
    assert Counter(replay_id for _, replay_id in states.values()) == {1: 5}
    with app.app_context():
        [record] = db.session.scalars(select(Replay)).all()
        assert (record.matched, record.replayed, record.finished_at is not None) == (5, 5, True)
        db.session.rollback()
