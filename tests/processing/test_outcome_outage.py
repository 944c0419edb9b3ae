"""The database away while a delivery runs: the worker waits it out, it fails no delivery.

A forward's call in flight: the outcome is written once the database is back.

The call succeeded (the target applied the event), but the worker could
not write the outcome: the delivery stayed in progress until its lease
ended, then was claimed again, counting an attempt, and sent again; on its
last allowed attempt it went dead ("out of attempts; the last one's lease
expired") though the target had answered 200. The worker's own database
must never fail a delivery.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
import pytest

from webhook_receiver import database
from webhook_receiver.database import unit_of_work
from webhook_receiver.outbox import deliveries

from ..servers import wait_until
from .conftest import FAST, config_with, delivery, drain, forward, store_event


class _Target:
    """A loopback target that runs ``on_request`` before it answers ``status``."""

    def __init__(self, on_request: Callable[[], None], status: int = 200) -> None:
        self.calls = 0
        target = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                target.calls += 1
                on_request()
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Outage:
    """Takes the database's deliveries away from everyone else until ``end``.

    PostgreSQL: an EXCLUSIVE lock on the table (the worker's statement
    timeout, 1 s here, then cancels its writes). SQLite: the write lock (its
    busy timeout, 10 s, then refuses them).
    """

    def __init__(self, db_url: str, tables: str = "deliveries", mode: str = "EXCLUSIVE") -> None:
        self.db_url = db_url
        self.tables = tables
        # ACCESS EXCLUSIVE keeps the readers away too.
        self.mode = mode
        self._conn: Any = None
        self.began = threading.Event()

    def begin(self) -> None:
        if self.db_url.startswith("sqlite:///"):
            path = self.db_url.removeprefix("sqlite:///")
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            conn.execute("BEGIN IMMEDIATE")
        else:
            conn = psycopg.connect(self.db_url.replace("postgresql+psycopg://", "postgresql://"))
            conn.execute(f"LOCK TABLE {self.tables} IN {self.mode} MODE")
        self._conn = conn
        self.began.set()

    def end(self) -> None:
        if self._conn is not None:
            self._conn.rollback()
            self._conn.close()
            self._conn = None


@pytest.fixture
def outage(db_url: str) -> Iterator[_Outage]:
    made = _Outage(db_url)
    yield made
    made.end()


def test_a_delivered_call_whose_outcome_meets_an_outage_is_recorded_once_it_ends(
    make_app, clock, make_worker, outage, caplog
):
    target = _Target(outage.begin)
    try:
        billing = forward("billing", target.url, max_attempts=1)
        app = make_app(
            config_with([billing]),
            **{**FAST, "WORKER_LEASE_SECONDS": 30, "DATABASE_STATEMENT_TIMEOUT_SECONDS": 1},
        )
        event_id = store_event(app, clock, dedup_key="evt-1")
        worker = make_worker(app, clock)
        thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
        with caplog.at_level(logging.WARNING, logger="webhook_receiver"):
            thread.start()
            assert outage.began.wait(15)
            # The outcome's write has failed at least once: the outage ends.
            assert wait_until(
                lambda: any("database unavailable" in r.getMessage() for r in caplog.records),
                timeout=20,
            )
            outage.end()
            assert wait_until(
                lambda: delivery(app, event_id, "billing")["state"] != "in_progress", timeout=20
            ), "the delivery stayed in progress: it waits for its lease to end"
            worker.stop()
            thread.join(30)
        assert not thread.is_alive()
        row = delivery(app, event_id, "billing")
        assert (row["state"], row["attempts"], row["response_status"]) == ("delivered", 1, 200)
        assert target.calls == 1
    finally:
        target.close()


def test_a_handler_that_meets_a_database_outage_is_given_back_not_failed(
    make_app, clock, make_worker, ledger, outage, caplog
):
    # The handler's transaction cannot lock its delivery (the database is
    # away): that is no failure of the handler. It was recorded as one,
    # counting the attempt, and with one attempt allowed the delivery was
    # dead.
    app = make_app(
        config_with([], handlers=True),
        **{
            **FAST,
            "WORKER_MAX_ATTEMPTS": 1,
            "WORKER_LEASE_SECONDS": 30,
            "DATABASE_STATEMENT_TIMEOUT_SECONDS": 1,
        },
    )
    ledger(app)
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.refunded")
    worker = make_worker(app, clock)
    with app.app_context(), unit_of_work():
        claim = deliveries.claim_next(clock(), timedelta(seconds=30))
    assert claim is not None and claim.consumer == "audit"
    outage.begin()
    outcomes = []

    def attempt() -> None:
        with app.app_context():
            outcomes.append(worker.attempt(claim))

    thread = threading.Thread(target=attempt)
    with caplog.at_level(logging.WARNING, logger="webhook_receiver"):
        thread.start()
        # SQLite: the busy timeout (10 s) for each write that waits.
        assert wait_until(
            lambda: any("database unavailable" in r.getMessage() for r in caplog.records),
            timeout=40,
        )
        outage.end()
        thread.join(30)
    assert not thread.is_alive()
    row = delivery(app, event_id, "audit")
    assert (row["state"], row["attempts"]) == ("pending", 0), row["last_error"]
    assert ledger(app) == []
    clock.advance(60)
    assert drain(app, worker) == ["delivered"]
    assert ledger(app) == [(event_id, "audit")]


def test_a_failed_call_whose_circuit_write_meets_an_outage_is_still_retried(
    make_app, clock, make_worker, db_url, caplog
):
    # The circuit's bookkeeping after the call (a failure counted) met the
    # outage and raised before the outcome was written: the delivery stayed
    # in progress until its lease ended.
    outage = _Outage(db_url, tables="deliveries, delivery_targets")
    target = _Target(outage.begin, status=500)
    app = make_app(
        config_with([forward("billing", target.url)]),
        **{**FAST, "WORKER_LEASE_SECONDS": 30, "DATABASE_STATEMENT_TIMEOUT_SECONDS": 1},
    )
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    try:
        with caplog.at_level(logging.WARNING, logger="webhook_receiver"):
            thread.start()
            assert outage.began.wait(15)
            assert wait_until(
                lambda: any("database unavailable" in r.getMessage() for r in caplog.records),
                timeout=40,
            )
            outage.end()
            assert wait_until(
                lambda: delivery(app, event_id, "billing")["state"] != "in_progress", timeout=40
            ), "the delivery stayed in progress: it waits for its lease to end"
        row = delivery(app, event_id, "billing")
        assert (row["state"], row["attempts"], row["response_status"]) == ("pending", 1, 500)
        assert target.calls == 1
    finally:
        outage.end()
        worker.stop()
        if thread.is_alive():
            thread.join(30)
        target.close()
    assert not thread.is_alive()


def test_a_rate_limited_forward_whose_slot_meets_an_outage_is_given_back_not_spent(
    make_app, clock, make_worker, downstream, db_url, caplog
):
    # The rate limit's slot (a write to the target's row) met the outage
    # before the call: the exception left the delivery in progress until its
    # lease ended, and the next claim counted an attempt; with one allowed,
    # it went dead without a call.
    outage = _Outage(db_url, tables="delivery_targets")
    billing = forward("billing", downstream.url + "/billing", max_per_second=5, max_attempts=1)
    app = make_app(
        config_with([billing]),
        **{**FAST, "WORKER_LEASE_SECONDS": 30, "DATABASE_STATEMENT_TIMEOUT_SECONDS": 1},
    )
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    with app.app_context(), unit_of_work():
        claim = deliveries.claim_next(clock(), timedelta(seconds=30))
    assert claim is not None
    try:
        _attempt_through(outage, app, worker, claim, caplog)
    finally:
        outage.end()
    _given_back_then_delivered(app, worker, clock, event_id, downstream)


def test_a_claimed_forward_whose_event_read_meets_an_outage_is_given_back_not_spent(
    make_app, clock, make_worker, downstream, db_url, caplog
):
    # The event's read after the claim was cancelled by the statement
    # timeout: the exception left the delivery in progress until its lease
    # ended, and the next claim counted an attempt; with one allowed, it
    # went dead without a call.
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite's readers (WAL) wait for no writer: its read meets no such outage")
    outage = _Outage(db_url, tables="events", mode="ACCESS EXCLUSIVE")
    billing = forward("billing", downstream.url + "/billing", max_attempts=1)
    app = make_app(
        config_with([billing]),
        **{**FAST, "WORKER_LEASE_SECONDS": 30, "DATABASE_STATEMENT_TIMEOUT_SECONDS": 1},
    )
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    with app.app_context(), unit_of_work():
        claim = deliveries.claim_next(clock(), timedelta(seconds=30))
    assert claim is not None
    outage.begin()
    try:
        with caplog.at_level(logging.WARNING, logger="webhook_receiver"), app.app_context():
            outcome = worker.attempt(claim)
    finally:
        outage.end()
    assert outcome.outcome == "held"
    assert any("given back unattempted" in r.getMessage() for r in caplog.records)
    _given_back_then_delivered(app, worker, clock, event_id, downstream)


def test_a_handler_whose_own_query_always_times_out_is_retried_then_dead(
    make_app, clock, make_worker, monkeypatch
):
    # The handler's statement timed out on a database that answers: counted
    # as the database away, it was handed back uncounted each time, never
    # reached its attempt limit, and was retried for ever.
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 500)
    config = config_with([])
    config["handlers"] = ["tests.processing.stuck_handlers"]
    app = make_app(
        config,
        **{**FAST, "WORKER_LEASE_SECONDS": 30, "DATABASE_STATEMENT_TIMEOUT_SECONDS": 1},
    )
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.refunded")
    worker = make_worker(app, clock)
    with app.app_context():
        first = worker.run_once()
    assert first is not None and first.outcome == "retry"
    row = delivery(app, event_id, "stuck")
    assert (row["state"], row["attempts"]) == ("pending", 1)
    assert "statement timeout" in row["last_error"] or "locked" in row["last_error"]
    clock.advance(3600)
    with app.app_context():
        second = worker.run_once()
    assert second is not None and second.outcome == "dead"
    row = delivery(app, event_id, "stuck")
    assert (row["state"], row["attempts"]) == ("dead", 2)
    assert row["last_error"].startswith("out of attempts (2)")


def test_an_ordered_forward_whose_stale_check_meets_an_outage_is_given_back_not_spent(
    make_app, clock, make_worker, downstream, outage, caplog
):
    # The ordering check before the call (a fenced write to the delivery)
    # met the outage: the exception left the delivery in progress until its
    # lease ended, and the next claim counted an attempt; with one allowed,
    # it went dead without a call.
    billing = forward("billing", downstream.url + "/billing", max_attempts=1)
    app = make_app(
        config_with([billing], ordered=True),
        **{**FAST, "WORKER_LEASE_SECONDS": 30, "DATABASE_STATEMENT_TIMEOUT_SECONDS": 1},
    )
    event_id = store_event(
        app, clock, dedup_key="evt-1", data={"object": {"id": "order-1", "version": 1}}
    )
    worker = make_worker(app, clock)
    with app.app_context(), unit_of_work():
        claim = deliveries.claim_next(clock(), timedelta(seconds=30))
    assert claim is not None
    _attempt_through(outage, app, worker, claim, caplog)
    _given_back_then_delivered(app, worker, clock, event_id, downstream)


def _attempt_through(outage: _Outage, app: Any, worker: Any, claim: Any, caplog: Any) -> None:
    """Attempt ``claim`` in a thread during an outage, ended once the worker says it waits.

    The attempt must neither raise nor outlive the outage.
    """
    outage.begin()
    errors: list[BaseException] = []

    def attempt() -> None:
        with app.app_context():
            try:
                worker.attempt(claim)
            except BaseException as exc:
                errors.append(exc)

    thread = threading.Thread(target=attempt)
    with caplog.at_level(logging.WARNING, logger="webhook_receiver"):
        thread.start()
        assert wait_until(
            lambda: (
                not thread.is_alive()
                or any("database unavailable" in r.getMessage() for r in caplog.records)
            ),
            timeout=40,
        )
        outage.end()
        thread.join(30)
    assert not thread.is_alive()
    assert errors == [], errors


def _given_back_then_delivered(
    app: Any, worker: Any, clock: Any, event_id: int, downstream: Any
) -> None:
    """The billing delivery was handed back uncounted and uncalled, then goes out once."""
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"]) == ("pending", 0)
    assert downstream.calls == []
    clock.advance(60)
    assert drain(app, worker) == ["delivered"]
    assert len(downstream.calls_to("/billing")) == 1


@pytest.mark.parametrize("consumer", ["idle_then_query", "idle_then_return"])
def test_a_handler_idle_past_the_idle_in_transaction_timeout_is_retried_then_dead(
    make_app, clock, make_worker, db_url, consumer
):
    # The handler waited in Python with its transaction open past
    # PostgreSQL's idle_in_transaction_session_timeout: the server ended the
    # session (25P03), which the worker took for the database away. Handed
    # back uncounted each time, it never reached its attempt limit. Whether
    # its next statement or the worker's own (the done-marker) met the closed
    # session, the idle time was the handler's.
    config = config_with([])
    config["handlers"] = ["tests.processing.idle_handlers"]
    app = make_app(config, **{**FAST, "WORKER_LEASE_SECONDS": 30})
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.idle")
    worker = make_worker(app, clock)
    if db_url.startswith("sqlite"):
        # No such timeout: the idle handler is delivered.
        assert sorted(drain(app, worker)) == ["delivered", "delivered"]
        assert delivery(app, event_id, consumer)["state"] == "delivered"
        return
    assert sorted(drain(app, worker)) == ["retry", "retry"]
    row = delivery(app, event_id, consumer)
    assert (row["state"], row["attempts"]) == ("pending", 1), row["last_error"]
    assert "idle_in_transaction_session_timeout" in row["last_error"]
    clock.advance(3600)
    assert sorted(drain(app, worker)) == ["dead", "dead"]
    row = delivery(app, event_id, consumer)
    assert (row["state"], row["attempts"]) == ("dead", 2)
    assert row["last_error"].startswith("out of attempts (2)")
    assert "idle_in_transaction_session_timeout" in row["last_error"]


def test_a_handler_whose_session_the_server_ends_is_given_back_not_failed(
    make_app, clock, make_worker, db_url
):
    # What a server shutting down does to each session (57P01, the
    # connection closed) stays the database away: given back uncounted, even
    # on the one attempt allowed, and delivered once the database answers.
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite has no server to end a session")
    config = config_with([])
    config["handlers"] = ["tests.processing.idle_handlers"]
    app = make_app(config, **{**FAST, "WORKER_LEASE_SECONDS": 30})
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.terminated")
    worker = make_worker(app, clock)
    with app.app_context():
        first = worker.run_once()
    assert first is not None and first.outcome == "held"
    row = delivery(app, event_id, "terminated")
    assert (row["state"], row["attempts"]) == ("pending", 0), row["last_error"]
