"""An attempt's outcome and its row of the attempt log, written together.

On PostgreSQL one autocommitted statement writes both (a data-modifying
CTE); on SQLite one transaction. Either way the row is written even when
the lease was lost, and the delivery is then left to its new holder.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, text, update
from sqlalchemy.exc import IntegrityError

from webhook_receiver.database import unit_of_work
from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery
from webhook_receiver.outbox import deliveries

from . import handlers as test_handlers
from .conftest import FAST, Reply, config_with, delivery, drain, forward, store_event
from .test_attempt_log import attempt_rows

LEASE = timedelta(seconds=5)


def _app(make_app, downstream):
    return make_app(config_with([forward("billing", downstream.url + "/billing")]), **FAST)


def _claim(clock) -> deliveries.Claim:
    with unit_of_work():
        claim = deliveries.claim_next(clock(), LEASE)
    assert claim is not None
    return claim


@pytest.mark.parametrize(
    ("status", "logged"),
    [(200, "delivered"), (503, "retryable_failure"), (410, "permanent_failure")],
)
def test_a_lease_lost_during_the_call_leaves_the_delivery_and_logs_the_attempt(
    make_app, downstream, clock, make_worker, status, logged
):
    app = _app(make_app, downstream)
    downstream.replies["/billing"] = [Reply(status, body=b"answer")]
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    with app.app_context():
        first = _claim(clock)
        clock.advance(10)  # the first lease expires: another worker takes the delivery over
        second = _claim(clock)
        outcome = worker.attempt(first)
    assert outcome.outcome == "lease_lost"
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["lease_token"], row["attempts"]) == (
        "in_progress",
        second.token,
        2,
    )
    assert (row["last_error"], row["response_status"], row["completed_at"]) == (None, None, None)
    # As when the row and the outcome were two statements of one transaction.
    [attempt] = attempt_rows(app)
    assert (attempt["delivery_id"], attempt["number"], attempt["outcome"], attempt["status"]) == (
        row["id"],
        1,
        logged,
        status,
    )


def test_each_attempt_copies_the_replay_that_queued_its_delivery(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream)
    downstream.replies["/billing"] = [Reply(503), Reply(410)]
    event_id = store_event(app, clock, dedup_key="evt-1")
    with app.app_context(), unit_of_work():
        db.session.execute(update(Delivery).values(replay_id=42))
    worker = make_worker(app, clock)
    assert drain(app, worker) == ["retry"]
    clock.advance(3600)
    assert drain(app, worker) == ["dead"]
    store_event(app, clock, dedup_key="evt-2")  # a delivery no replay queued
    assert drain(app, worker) == ["delivered"]
    rows = attempt_rows(app)
    assert [(r["outcome"], r["replay_id"]) for r in rows] == [
        ("retryable_failure", 42),
        ("permanent_failure", 42),
        ("delivered", None),
    ]
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["response_status"], row["lease_token"]) == ("dead", 410, None)


@contextmanager
def _statements() -> Iterator[list[tuple[str, bool, Any]]]:
    """The statements sent on the app's engine in the block: (SQL, in a transaction, isolation)."""
    seen: list[tuple[str, bool, Any]] = []
    engine = db.engine

    def before(conn, _cursor, statement, _parameters, _context, _many) -> None:
        isolation = conn.get_execution_options().get("isolation_level")
        seen.append((statement, conn.in_transaction(), isolation))

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", before)


def test_a_forward_outcome_is_one_statement_where_the_database_allows(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream)
    downstream.replies["/billing"] = [Reply(503), Reply(200)]
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    with app.app_context():
        sqlite = db.engine.dialect.name == "sqlite"
        for expected in ("retry", "delivered"):
            claim = _claim(clock)
            with _statements() as seen:
                assert worker.attempt(claim).outcome == expected
            writes = [s for s in seen if "delivery_attempts" in s[0]]
            if sqlite:
                # No data-modifying CTE: the row, then the outcome, in one transaction.
                [(insert, in_transaction, _)] = writes
                assert insert.startswith("INSERT INTO delivery_attempts") and in_transaction
            else:
                [(statement, _, isolation)] = writes
                assert statement.startswith("WITH finished AS \n(UPDATE deliveries SET")
                assert isolation == "AUTOCOMMIT"  # no BEGIN nor COMMIT around it
            clock.advance(3600)
    assert delivery(app, event_id, "billing")["state"] == "delivered"
    assert [r["outcome"] for r in attempt_rows(app)] == ["retryable_failure", "delivered"]


def test_an_outcome_whose_attempt_fails_to_write_changes_nothing(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream)
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    with app.app_context():
        claim = _claim(clock)
        # The attempt's row cannot be written: its outcome must not be either.
        with _refusing_attempt_rows(), pytest.raises(IntegrityError, match="no_rows|no rows"):
            worker.attempt(claim)
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["lease_token"]) == ("in_progress", claim.token)
    assert attempt_rows(app) == []


@contextmanager
def _refusing_attempt_rows() -> Iterator[None]:
    """Make every INSERT into delivery_attempts fail, for the block (the schema outlives a test)."""
    sqlite = db.engine.dialect.name == "sqlite"
    with unit_of_work():
        db.session.execute(
            text(
                "CREATE TRIGGER no_rows BEFORE INSERT ON delivery_attempts "
                "BEGIN SELECT RAISE(ABORT, 'no rows'); END"
                if sqlite
                else "ALTER TABLE delivery_attempts ADD CONSTRAINT no_rows CHECK (number < 0)"
            )
        )
    try:
        yield
    finally:
        with unit_of_work():
            db.session.execute(
                text(
                    "DROP TRIGGER no_rows"
                    if sqlite
                    else "ALTER TABLE delivery_attempts DROP CONSTRAINT no_rows"
                )
            )


@pytest.mark.parametrize("log", [True, False], ids=["logged", "log_off"])
def test_an_answer_holding_a_nul_character_is_recorded_all_the_same(
    make_app, downstream, clock, make_worker, log
):
    # PostgreSQL's text refuses NUL: an answer's body (or the error quoting
    # it) that holds one failed the outcome's write, so a 2xx was sent again
    # at each lease's end until it went dead. Both databases store U+FFFD.
    app = make_app(
        config_with([forward("billing", downstream.url + "/billing")]),
        **FAST,
        WORKER_ATTEMPT_LOG=log,
    )
    downstream.replies["/billing"] = [Reply(500, body=b"down\x00now"), Reply(200, body=b"ok\x00")]
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    assert drain(app, worker) == ["retry"]
    assert delivery(app, event_id, "billing")["last_error"] == "HTTP 500: down\ufffdnow"
    clock.advance(3600)
    assert drain(app, worker) == ["delivered"]
    assert delivery(app, event_id, "billing")["state"] == "delivered"
    assert len(downstream.calls_to("/billing")) == 2
    expected = [("HTTP 500: down\ufffdnow", "down\ufffdnow"), (None, "ok\ufffd")] if log else []
    assert [(r["error"], r["response_body"]) for r in attempt_rows(app)] == expected


@pytest.mark.parametrize("log", [True, False], ids=["log", "no-log"])
def test_a_handler_error_not_encodable_as_utf8_is_recorded_all_the_same(
    make_app, clock, make_worker, ledger, log
):
    # A handler's exception message is the user's text: one holding a lone
    # surrogate (half of a UTF-16 pair, from a badly decoded payload, say)
    # cannot be encoded for either database, and the outcome's write failed
    # on every lease's end. Stored with the character replaced, it retries.
    app = make_app(config_with(handlers=True), **FAST, WORKER_ATTEMPT_LOG=log)
    ledger(app)
    test_handlers.failures["ledger"] = 1
    test_handlers.failure_messages["ledger"] = "ledger refused \ud800 in the payload"
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.paid")
    worker = make_worker(app, clock)
    assert sorted(drain(app, worker)) == ["delivered", "retry"]
    expected = "RuntimeError: ledger refused ? in the payload"
    assert delivery(app, event_id, "ledger")["last_error"] == expected
    clock.advance(3600)
    assert drain(app, worker) == ["delivered"]
    assert delivery(app, event_id, "ledger")["state"] == "delivered"
    errors = [r["error"] for r in attempt_rows(app) if r["error"] is not None]
    assert errors == ([expected] if log else [])
