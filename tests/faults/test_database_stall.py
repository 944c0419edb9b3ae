"""A database that stalls: a statement stuck on a lock another connection holds.

PostgreSQL connections carry TCP keepalives and a statement timeout: the
stuck statement is cancelled (SQLSTATE 57014) and answered as the database
being away. SQLite's equivalent is its busy timeout. Either way, a call
wrapped in ``database.stall_watch`` logs one warning while it is stuck.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError

from webhook_receiver.database import POSTGRESQL_KEEPALIVES, is_unavailable, stall_watch
from webhook_receiver.extensions import db
from webhook_receiver.models import utcnow
from webhook_receiver.outbox import deliveries
from webhook_receiver.processing.worker import Worker

from ..conftest import bearer
from ..processing.conftest import (
    FAST,
    Clock,
    Downstream,
    config_with,
    delivery,
    forward,
    store_event,
)
from ..servers import wait_until

LEASE = timedelta(seconds=5)
STALLED = "database stalled"
FINISHED = "database call finished after stalling"
on_postgresql = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)


@pytest.fixture
def downstream() -> Iterator[Downstream]:
    server = Downstream()
    server.start()
    try:
        yield server
    finally:
        server.close()


def _lines(caplog: pytest.LogCaptureFixture, start: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "webhook_receiver.database" and r.getMessage().startswith(start)
    ]


@contextmanager
def locked(db_url: str, table: str) -> Iterator[None]:
    """Another connection holds ``table`` (PostgreSQL) or the file (SQLite) for the block."""
    if db_url.startswith("sqlite"):
        holder = sqlite3.connect(db_url.removeprefix("sqlite:///"), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the write lock; readers go on (WAL)
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        return
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            conn.execute(text(f"LOCK TABLE {table} IN EXCLUSIVE MODE"))  # writers wait
            try:
                yield
            finally:
                conn.rollback()
    finally:
        engine.dispose()


def test_stall_watch_warns_once_when_a_block_overruns_and_says_when_it_ends(caplog):
    with caplog.at_level(logging.INFO, logger="webhook_receiver.database"):
        with stall_watch("quick call", after=0.2):
            pass
        with stall_watch("slow call", after=0.1, worker="w-1"):
            time.sleep(0.5)
        with pytest.raises(ZeroDivisionError), stall_watch("failing call", after=5):
            1 / 0  # noqa: B018
    warnings = _lines(caplog, STALLED)
    assert [(r.levelno, r.what, r.worker) for r in warnings] == [
        (logging.WARNING, "slow call", "w-1")
    ]
    assert 0.1 <= warnings[0].stalled_seconds < 0.5
    finished = _lines(caplog, FINISHED)
    assert [(r.levelno, r.what) for r in finished] == [(logging.INFO, "slow call")]
    assert finished[0].stalled_seconds >= 0.5


def test_blocks_of_one_kind_stalled_together_are_one_stall_said_once_ended_by_the_last(caplog):
    # A worker's threads claim at once: one stall of its database is one
    # warning and one end, whichever of its blocks ends last.
    def block(what: str, source: str, seconds: float) -> threading.Thread:
        def run() -> None:
            with stall_watch(what, after=0.1, source=source):
                time.sleep(seconds)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    with caplog.at_level(logging.INFO, logger="webhook_receiver.database"):
        threads = [
            block("worker claim", "feed", 0.4),
            block("worker claim", "feed", 0.8),
            block("broker batch store", "other", 0.4),  # another kind: its own stall
        ]
        for thread in threads:
            thread.join()
    warnings = _lines(caplog, STALLED)
    assert sorted(r.source for r in warnings) == ["feed", "other"]
    finished = _lines(caplog, FINISHED)
    assert sorted(r.source for r in finished) == ["feed", "other"]
    feed = next(r for r in finished if r.source == "feed")
    assert feed.stalled_seconds >= 0.8  # said when the last of the two ended


@on_postgresql
def test_postgresql_cancels_a_statement_stuck_on_a_lock_as_the_database_being_away(
    make_app, db_url, caplog
):
    app = make_app(DATABASE_STATEMENT_TIMEOUT_SECONDS=1, DATABASE_STALL_WARNING_SECONDS=0.3)
    with app.app_context():
        with db.engine.connect() as conn:
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "1s"
            params = conn.connection.dbapi_connection.info.get_parameters()
            assert {k: params.get(k) for k in POSTGRESQL_KEEPALIVES} == {
                k: str(v) for k, v in POSTGRESQL_KEEPALIVES.items()
            }
        with caplog.at_level(logging.INFO, logger="webhook_receiver.database"):
            with locked(db_url, "deliveries"):
                started = time.monotonic()
                with pytest.raises(DBAPIError) as raised, stall_watch("claim"):
                    deliveries.claim_next(utcnow(), LEASE)
                waited = time.monotonic() - started
            db.session.rollback()
    assert 0.9 <= waited < 5, waited
    assert getattr(raised.value.orig, "sqlstate", None) == "57014"
    assert is_unavailable(raised.value)
    assert [r.what for r in _lines(caplog, STALLED)] == ["claim"]
    assert len(_lines(caplog, FINISHED)) == 1


@on_postgresql
def test_postgresql_a_request_whose_statement_times_out_is_answered_503(make_app, db_url):
    app = make_app(DATABASE_STATEMENT_TIMEOUT_SECONDS=1)
    client = app.test_client()
    headers = {**bearer(), "Idempotency-Key": "stalled-1"}
    with locked(db_url, "events, idempotency_records"):
        started = time.monotonic()
        response = client.post("/api/events", json={"type": "t", "data": 1}, headers=headers)
        waited = time.monotonic() - started
    assert response.status_code == 503, response.get_data(as_text=True)
    assert response.get_json()["type"] == "/problems/database-unavailable"
    assert waited < 5, waited
    # Once the lock is gone, the same request goes through.
    response = client.post("/api/events", json={"type": "t", "data": 1}, headers=headers)
    assert response.status_code == 201, response.get_data(as_text=True)


def test_the_worker_warns_once_while_its_claim_is_stuck_then_delivers(
    make_app, db_url, downstream, caplog
):
    # Locked for less than the statement timeout (PostgreSQL) or the busy
    # timeout (SQLite): the claim waits, the worker says so once, then goes on.
    config = config_with([forward("billing", downstream.url + "/billing")])
    app = make_app(
        config, **FAST, DATABASE_STATEMENT_TIMEOUT_SECONDS=8, DATABASE_STALL_WARNING_SECONDS=0.3
    )
    clock = Clock()
    event_id = store_event(app, clock, dedup_key="evt-stall")
    worker = Worker(app, clock=clock)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    with caplog.at_level(logging.INFO, logger="webhook_receiver"):
        with locked(db_url, "deliveries"):
            thread.start()
            assert wait_until(lambda: _lines(caplog, STALLED), timeout=5)
            time.sleep(0.5)
            assert downstream.calls == []
            # Only what was said while the lock held counts: a loaded machine
            # may pause any later call past the threshold, and that warning
            # would be true too.
            while_locked = [(r.what, r.worker) for r in _lines(caplog, STALLED)]
        assert wait_until(
            lambda: delivery(app, event_id, "billing")["state"] == "delivered", timeout=10
        )
        worker.stop()
        thread.join(10)
    worker.http.close()
    assert not thread.is_alive()
    assert while_locked == [("worker claim", worker.name)]
    assert _lines(caplog, FINISHED)[0].what == "worker claim"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(downstream.calls) == 1


@on_postgresql
def test_postgresql_the_worker_retries_after_its_claim_times_out(
    make_app, db_url, downstream, caplog
):
    config = config_with([forward("billing", downstream.url + "/billing")])
    app = make_app(
        config, **FAST, DATABASE_STATEMENT_TIMEOUT_SECONDS=0.5, DATABASE_STALL_WARNING_SECONDS=0.2
    )
    clock = Clock()
    event_id = store_event(app, clock, dedup_key="evt-timeout")
    worker = Worker(app, clock=clock)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    unavailable = "database unavailable"
    with caplog.at_level(logging.INFO, logger="webhook_receiver"):
        with locked(db_url, "deliveries"):
            thread.start()
            assert wait_until(
                lambda: any(unavailable in r.getMessage() for r in caplog.records), timeout=5
            )
        assert wait_until(
            lambda: delivery(app, event_id, "billing")["state"] == "delivered", timeout=10
        )
        worker.stop()
        thread.join(10)
    worker.http.close()
    assert not thread.is_alive()
    timed_out = [r for r in caplog.records if unavailable in r.getMessage()]
    assert all(r.levelno == logging.WARNING and not r.exc_info for r in timed_out)
    assert "statement timeout" in timed_out[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"]) == ("delivered", 1)
