"""Batches stored at once by several consumers: their keys' locks, and the conflicts between them.

Every test runs on SQLite and PostgreSQL; SQLite has one write lock for
the whole database (a writer waits for the other to commit), PostgreSQL a
lock per key, taken by each row the batch's INSERT writes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from webhook_receiver import inbox
from webhook_receiver.brokers import batch as broker_batch
from webhook_receiver.database import CONFLICT_ATTEMPTS, is_conflict, is_unavailable
from webhook_receiver.extensions import db
from webhook_receiver.models import Event

from ..helpers import RABBIT_SOURCE
from .test_positions import SOURCE, _config, _count, _sqlite, at, message


def _sessions_waiting_on_a_lock(engine: Any, wanted: int, threads: list[Any]) -> bool:
    """Poll (10 s at most) until ``wanted`` sessions wait on a lock; False if they never do."""
    query = text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database()"
    )
    deadline = time.monotonic() + 10
    with engine.connect() as watcher:
        while time.monotonic() < deadline:
            if watcher.execute(query).scalar() >= wanted:
                return True
            watcher.rollback()
            if not all(thread.is_alive() for thread in threads):
                return False  # one ended (stored, or failed) without waiting
            threads[0].join(0.01)
    return False


def _storing(
    app: Any, keys: list[str], results: dict[str, Any], positions: Sequence[inbox.Position] = ()
) -> threading.Thread:
    """A thread that stores the batch of ``keys`` (a consumer), its outcomes or error in results."""

    def store() -> None:
        with app.app_context():
            try:
                results[",".join(keys)] = inbox.receive_many(
                    [message(k) for k in keys], positions=positions
                )
            except Exception as exc:  # what the test looks at
                results[",".join(keys)] = exc

    thread = threading.Thread(target=store, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def locking(make_app, caplog) -> Iterator[Any]:
    """The app, in its context, its INFO lines captured (skipped on SQLite: no row locks)."""
    app = make_app(_config())
    caplog.set_level(logging.INFO, logger="webhook_receiver")
    with app.app_context():
        if _sqlite():
            pytest.skip("SQLite has no lock per key or row: one writer at a time, no deadlock")
        yield app


def _crossing(
    app: Any,
    first: list[str],
    second: list[str],
    positions: tuple[Sequence[inbox.Position], Sequence[inbox.Position]] = ((), ()),
) -> tuple[Any, Any]:
    """Store two batches at once, in the app's context; each one's outcomes.

    The first waits on what this session holds (an uncommitted row), the
    second starts and waits too, then this session lets go: both must end,
    neither with an error.
    """
    results: dict[str, Any] = {}
    one = _storing(app, first, results, positions[0])
    assert _sessions_waiting_on_a_lock(db.engine, 1, [one])
    other = _storing(app, second, results, positions[1])
    assert _sessions_waiting_on_a_lock(db.engine, 2, [one, other])
    db.session.rollback()  # the held row let go: the first batch goes on
    one.join(30)
    other.join(30)
    assert not one.is_alive() and not other.is_alive()
    stored = results[",".join(first)], results[",".join(second)]
    for outcomes in stored:
        assert not isinstance(outcomes, Exception), outcomes
    return stored


def test_overlapping_batches_in_opposite_orders_are_both_stored_the_deadlock_retried(
    locking, caplog
):
    # Two consumers store batches whose keys overlap, in opposite orders. Each
    # batch's INSERT locks its rows' keys one after the other, in the order
    # the messages came (so that event ids follow it): the first batch holds
    # "a" and waits for "c", which the second holds while it waits for "a":
    # PostgreSQL's deadlock (SQLSTATE 40P01). Its victim is stored again at
    # once (database.retrying_conflicts), never taken for the database being
    # away. A held key ("b", an uncommitted event) pauses the first batch
    # between its keys, so that the second starts while the first holds "a".
    held = inbox.add(message("b"))  # this session's transaction, not committed
    assert held is not None
    # The first waits on "b", "a" inserted; "b" let go, it goes on.
    one, other = _crossing(locking, ["a", "b", "c"], ["c", "a"])
    ids = {key: outcome.event_id for key, outcome in zip("abc", one, strict=True)}
    ids |= {key: outcome.event_id for key, outcome in zip("ca", other, strict=True)}
    # Each key stored once, by one batch or the other; the other found it.
    kinds = sorted(type(o).__name__ for o in [*one, *other])
    assert kinds == ["Accepted"] * 3 + ["Duplicate"] * 2
    rows = db.session.execute(
        text("SELECT dedup_key, id FROM events WHERE dedup_key IN ('a', 'b', 'c')")
    ).all()
    db.session.rollback()
    assert dict(rows) == ids
    # The deadlock happened, and its victim was stored on its next attempt.
    assert [r for r in caplog.records if "retrying" in r.getMessage()]


def test_batches_moving_the_same_partitions_in_opposite_orders_wait_rather_than_deadlock(
    locking, caplog
):
    # Two consumers of one source (a rebalance) move the same partitions, in
    # opposite orders: each position's upsert locks its row until the batch
    # commits. A held row (partition 1, updated in an open transaction)
    # pauses the first batch between its positions, so that the second
    # starts while the first holds partition 0: the interleaving of a
    # deadlock, unless both take the rows in one order.
    inbox.receive_many([], positions=[at(0, 1), at(1, 1), at(2, 1)])
    db.session.execute(text("UPDATE broker_positions SET next_offset = 2 WHERE partition = 1"))
    # The first waits on partition 1; partition 1 let go, it goes on.
    _crossing(locking, ["p"], ["q"], ([at(0, 5), at(1, 5), at(2, 5)], [at(2, 6), at(0, 6)]))
    moved = inbox.stored_positions(SOURCE)
    assert moved == {("orders", 0): 6, ("orders", 1): 5, ("orders", 2): 6}
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


def test_a_batch_is_settled_per_message_its_new_ids_in_the_messages_order(
    make_app,
):
    # Outcomes come back in the caller's order, a key repeated in the batch
    # is settled against its first copy, and the new events' ids follow the
    # messages' order (the admin, the API and the worker read events by id).
    app = make_app(_config())
    with app.app_context():
        stored = inbox.receive(message("m"))
        assert isinstance(stored, inbox.Accepted)
        batch = [
            message("z"),
            message("m", fingerprint="b" * 64),  # a conflict with the stored event
            message("a"),
            message("z", fingerprint="c" * 64),  # a conflict with the batch's first "z"
            message("a"),  # a duplicate of the batch's first "a"
            message("k"),
        ]
        outcomes = inbox.receive_many(batch)
        assert [type(o) for o in outcomes] == [
            inbox.Accepted,
            inbox.Conflict,
            inbox.Accepted,
            inbox.Conflict,
            inbox.Duplicate,
            inbox.Accepted,
        ]
        z, a, k = outcomes[0].event_id, outcomes[2].event_id, outcomes[5].event_id
        assert outcomes[1].event_id == stored.event_id
        assert outcomes[3].event_id == z and outcomes[4].event_id == a
        db.session.rollback()
        rows = db.session.execute(
            text("SELECT dedup_key, id FROM events WHERE dedup_key IN ('z', 'a', 'k')")
        ).all()
        db.session.rollback()
        assert dict(rows) == {"z": z, "a": a, "k": k}
        assert z < a < k


def test_a_batch_chosen_as_a_deadlock_s_victim_is_stored_again_at_once(make_app, caplog):
    # A deadlock the key order cannot prevent (another transaction taking
    # keys in an order of its own): PostgreSQL rolls one transaction back
    # (SQLSTATE 40P01). The batch it chose was taken for the database being
    # away (a back-off, a 503); it is run again at once, and stored. Three
    # sessions make the deadlock, the batch always its victim: "b" held by
    # one pauses the batch after "a"; the other, holding "c", waits for "a"
    # (its own deadlock check put off for a minute); "b" let go, the batch
    # waits for "c" and, its check first, finds the cycle.
    app = make_app(_config())
    caplog.set_level(logging.INFO, logger="webhook_receiver")
    with app.app_context():
        if _sqlite():
            pytest.skip("SQLite has no lock per key: one writer at a time, no deadlock")
        engine = db.engine
        pausing, crossing = engine.connect(), engine.connect()
        try:
            pausing.execute(text("SET LOCAL deadlock_timeout = '60s'"))
            crossing.execute(text("SET LOCAL deadlock_timeout = '60s'"))
            _insert(pausing, "b")
            _insert(crossing, "c")
            results: dict[str, Any] = {}
            batch = _storing(app, ["a", "b", "c"], results)
            assert _sessions_waiting_on_a_lock(engine, 1, [batch])  # on "b", "a" inserted
            cross = threading.Thread(target=_insert, args=(crossing, "a"), daemon=True)
            cross.start()
            assert _sessions_waiting_on_a_lock(engine, 2, [batch, cross])  # "c"'s on "a"
            pausing.rollback()  # the batch goes on to "c": the cycle
            cross.join(30)  # the batch rolled back, "a" is the other session's
            assert not cross.is_alive()
            assert _sessions_waiting_on_a_lock(engine, 1, [batch]), results  # tried again
            crossing.rollback()
            batch.join(30)
            assert not batch.is_alive()
        finally:
            pausing.close()
            crossing.close()
        stored = results["a,b,c"]
        assert not isinstance(stored, Exception), stored
        assert [type(outcome) for outcome in stored] == [inbox.Accepted] * 3
    retried = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retried) == 1 and retried[0].levelno == logging.WARNING
    assert "deadlock detected" in retried[0].getMessage()


def _insert(conn: Any, key: str) -> None:
    """Insert an event under ``key`` in ``conn``'s open transaction (a row lock on its key)."""
    conn.execute(
        text(
            "INSERT INTO events (source, dedup_key, fingerprint, body, headers, meta, received_at) "
            "VALUES (:source, :key, :print, '', '[]', '{}', now())"
        ),
        {"source": SOURCE, "key": key, "print": "a" * 64},
    )


@contextmanager
def _losing_races(sqlstate: str, times: int) -> Iterator[Any]:
    """The first ``times`` rows inserted into events fail with ``sqlstate`` (a lost race)."""
    db.session.rollback()
    with db.engine.begin() as conn:
        conn.execute(text("CREATE SEQUENCE lost_races"))
        conn.execute(
            text(
                "CREATE FUNCTION lose_race() RETURNS trigger LANGUAGE plpgsql AS $$ "
                f"BEGIN IF nextval('lost_races') <= {times} THEN "
                f"RAISE EXCEPTION 'injected race' USING ERRCODE = '{sqlstate}'; END IF; "
                "RETURN NEW; END $$"
            )
        )
        conn.execute(
            text(
                "CREATE TRIGGER lose_race BEFORE INSERT ON events "
                "FOR EACH ROW EXECUTE FUNCTION lose_race()"
            )
        )

    def tries() -> int:
        """How many times the trigger ran (a row inserted, or its statement failed)."""
        with db.engine.connect() as conn:
            return int(conn.execute(text("SELECT last_value FROM lost_races")).scalar_one())

    try:
        yield tries
    finally:
        with db.engine.begin() as conn:
            conn.execute(text("DROP TRIGGER lose_race ON events"))
            conn.execute(text("DROP FUNCTION lose_race()"))
            conn.execute(text("DROP SEQUENCE lost_races"))


@pytest.mark.parametrize("sqlstate", ["40P01", "40001"])
def test_a_batch_that_loses_a_race_is_stored_again_at_once_a_bounded_number_of_times(
    make_app, caplog, sqlstate
):
    # A deadlock (40P01) or a serialization failure (40001) rolls the batch
    # back: a transient conflict, not the database away. The batch is stored
    # again at once; a conflict that outlasts CONFLICT_ATTEMPTS is raised,
    # and answered as a busy database (a 503, a broker's back-off).
    app = make_app(_config())
    caplog.set_level(logging.INFO, logger="webhook_receiver")
    with app.app_context():
        if _sqlite():
            pytest.skip("SQLite has neither deadlocks nor serialization failures")
        with _losing_races(sqlstate, CONFLICT_ATTEMPTS - 1) as tries:
            verdicts = broker_batch.store(
                RABBIT_SOURCE, broker_batch.Prepared([message("x"), message("y")], [None, None])
            )
            # Each failed attempt ran the trigger once (its first row), the last one twice.
            assert tries() == CONFLICT_ATTEMPTS - 1 + 2
        assert [v.action for v in verdicts] == ["ack", "ack"]
        retried = [r for r in caplog.records if "retrying" in r.getMessage()]
        assert len(retried) == CONFLICT_ATTEMPTS - 1
        with _losing_races(sqlstate, 1000) as tries:
            with pytest.raises(DBAPIError) as raised:
                inbox.receive_many([message("z")])
            assert tries() == CONFLICT_ATTEMPTS
        assert is_conflict(raised.value) and is_unavailable(raised.value)
        assert _count(Event) == 2
