"""POST /api/events under one commit: crashes, racing requests and the lock timeout.

The claim, the event and the saved response are one transaction, so a
request that dies anywhere before its commit leaves nothing behind, and a
request racing it with the same key waits for that commit and answers from
it. Each scenario pauses the real request at a known point to make the
interleaving certain rather than likely. On SQLite the transaction is the
session's, and a hook pauses it right after one of its writes. On
PostgreSQL the three writes are one statement (the view's event is held
back until then, see inbox.holding), so the pause is inside that statement:
a trigger makes its event INSERT wait for an advisory lock the test holds,
after its record is written and before anything commits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any
from unittest.mock import patch

import pytest
from flask import Flask
from sqlalchemy import create_engine, event, func, select, text
from sqlalchemy.engine import Engine

from webhook_receiver import create_app, database, inbox
from webhook_receiver.extensions import db
from webhook_receiver.idempotency.persistence import records
from webhook_receiver.idempotency.persistence.records import COMPLETED
from webhook_receiver.models import Event, IdempotencyRecord

from ..conftest import CLIENTS, SECRET_KEY
from ..helpers import post_event
from ..servers import ROOT, wait_until

BODY = {"type": "order.created", "data": {"order": 42}}
OTHER_BODY = {"type": "order.created", "data": {"order": 43}}
WAIT = 20  # seconds any step may take before the test gives up on it


def stored(app: Flask) -> tuple[int, list[tuple[str, str]]]:
    """The number of events, and the (key, state) of every idempotency record."""
    with app.app_context():
        count = db.session.scalar(select(func.count()).select_from(Event))
        rows = db.session.execute(select(IdempotencyRecord.key, IdempotencyRecord.state)).all()
        db.session.rollback()
    return count, [tuple(row) for row in rows]


def engine_of(app: Flask) -> Engine:
    with app.app_context():
        return db.engine


# SQLite: the request's two writes, in its one transaction: the view's
# event, then the key's record with the saved answer. Hooked where the app
# calls them, since both run on the driver, unseen by SQLAlchemy's
# statement events. (On PostgreSQL the first hook sees the view's event
# held back, unwritten; the second is not called.)
WRITES = {
    "event": (inbox, "add"),
    "record": (records, "save_in_transaction"),
}


@contextmanager
def after_each_write(on_write: Callable[[str], None]) -> Iterator[None]:
    """Call ``on_write("event")`` or ``on_write("record")`` right after that write, uncommitted."""
    originals = {step: getattr(module, name) for step, (module, name) in WRITES.items()}

    def wrap(step: str) -> Callable[..., Any]:
        def written(*args: Any, **kwargs: Any) -> Any:
            result = originals[step](*args, **kwargs)
            on_write(step)
            return result

        return written

    for step, (module, name) in WRITES.items():
        setattr(module, name, wrap(step))
    try:
        yield
    finally:
        for step, (module, name) in WRITES.items():
            setattr(module, name, originals[step])


@contextmanager
def on_checkin(app: Flask, callback: Callable[[], None]) -> Iterator[None]:
    """Call ``callback()`` each time a connection goes back to the app's pool."""

    def checkin(*_args: Any) -> None:
        callback()

    engine = engine_of(app)
    event.listen(engine, "checkin", checkin)
    try:
        yield
    finally:
        event.remove(engine, "checkin", checkin)


def is_event_insert(step: str) -> bool:
    return step == "event"


def is_record_write(step: str) -> bool:
    return step == "record"


# -- crashes -----------------------------------------------------------------


def crash_after_the_event_insert(db_url: str, key: str) -> None:
    """In a process of its own: POST an event and die (os._exit) right after the view adds it.

    On SQLite the event is inserted, uncommitted; on PostgreSQL it is held
    for the request's one statement, not yet sent.
    """
    app = create_app(
        {
            "TESTING": True,
            "SECRET_KEY": SECRET_KEY,
            "SQLALCHEMY_DATABASE_URI": db_url,
            "RECEIVER_CONFIG": {"clients": CLIENTS},
        }
    )

    def die(step: str) -> None:
        if is_event_insert(step):
            os._exit(17)  # no rollback, no close: the process is gone mid-transaction

    with after_each_write(die):
        post_event(app.test_client(), key)
    os._exit(0)  # pragma: no cover (the request did not reach its event)


def test_a_process_dying_mid_transaction_leaves_the_key_free(app, db_url):
    crashed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tests.idempotency.test_one_commit import "
            "crash_after_the_event_insert as crash; crash(sys.argv[1], 'crash-key')",
            db_url,
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert crashed.returncode == 17, crashed.stderr.decode()
    assert stored(app) == (0, [])

    retry = post_event(app.test_client(), "crash-key")
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry.headers
    assert stored(app) == (1, [("crash-key", COMPLETED)])


# -- PostgreSQL: a request paused inside its one statement --------------------

_GATE_LOCK = 730_001  # the advisory lock the paused statements wait for


class StatementGate:
    """PostgreSQL: every event INSERT waits, inside its statement, until ``release()``.

    A trigger on ``events`` takes a shared advisory lock the gate holds
    exclusively. An API request's one statement has then written its
    record, uncommitted, and waits at its event: the interleaving a hook
    between two statements gives on SQLite.
    """

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self.engine = create_engine(db_url, isolation_level="AUTOCOMMIT")
        self.holder = self.engine.connect()

    def __enter__(self) -> StatementGate:
        self.holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _GATE_LOCK})
        self.holder.execute(
            text(
                "CREATE FUNCTION wait_at_the_gate() RETURNS trigger LANGUAGE plpgsql AS $$ "
                # The request's own lock timeout must not end its wait here.
                "BEGIN PERFORM set_config('lock_timeout', '0', true); "
                f"PERFORM pg_advisory_lock_shared({_GATE_LOCK}); "
                f"PERFORM pg_advisory_unlock_shared({_GATE_LOCK}); RETURN NEW; END $$"
            )
        )
        self.holder.execute(
            text(
                "CREATE TRIGGER wait_at_the_gate BEFORE INSERT ON events "
                "FOR EACH ROW EXECUTE FUNCTION wait_at_the_gate()"
            )
        )
        return self

    def release(self) -> None:
        self.holder.execute(text("SELECT pg_advisory_unlock_all()"))

    def waiting_backend(self) -> int:
        """The pid of the one backend waiting at the gate."""
        pids = self.holder.scalars(
            text(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
        ).all()
        assert len(pids) == 1, pids
        return int(pids[0])

    def __exit__(self, *exc: object) -> None:
        try:
            self.release()
            self.holder.execute(text("DROP TRIGGER IF EXISTS wait_at_the_gate ON events"))
            self.holder.execute(text("DROP FUNCTION IF EXISTS wait_at_the_gate()"))
        finally:
            self.holder.close()
            self.engine.dispose()


def post_and_wait(db_url: str, key: str) -> None:
    """In a process of its own: POST an event (the test kills this process meanwhile)."""
    app = create_app(
        {
            "TESTING": True,
            "SECRET_KEY": SECRET_KEY,
            "SQLALCHEMY_DATABASE_URI": db_url,
            "RECEIVER_CONFIG": {"clients": CLIENTS},
        }
    )
    post_event(app.test_client(), key)


def test_a_process_killed_inside_its_one_statement_leaves_all_or_nothing(app, db_url):
    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite's writes are a transaction: the crash test above covers it")
    with StatementGate(db_url) as gate:
        process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from tests.idempotency.test_one_commit import "
                "post_and_wait; post_and_wait(sys.argv[1], 'killed-key')",
                db_url,
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            # Its statement has written the record and waits at its event.
            assert wait_until(lambda: lock_waits(db_url) == 1, timeout=WAIT)
            process.kill()  # SIGKILL: no rollback, no goodbye to the server
            assert process.wait(WAIT) == -9
        finally:
            if process.poll() is None:  # pragma: no cover (the wait failed)
                process.kill()
        gate.release()
        # The server goes on with the statement of a client that is gone.
        assert wait_until(lambda: lock_waits(db_url) == 0, timeout=WAIT)
    # One statement: the record and the event together, or neither.
    assert wait_until(lambda: stored(app) in [(0, []), (1, [("killed-key", COMPLETED)])])
    before = stored(app)
    retry = post_event(app.test_client(), "killed-key")
    assert retry.status_code == 201
    # The retry answers from what was committed: the saved answer, or a first run.
    replayed = retry.headers.get("Idempotent-Replayed") == "true"
    assert replayed == (before[0] == 1)
    assert stored(app) == (1, [("killed-key", COMPLETED)])


def test_a_connection_terminated_mid_transaction_leaves_the_key_free(make_app, db_url):
    if not db_url.startswith("postgresql"):
        pytest.skip("pg_terminate_backend is PostgreSQL's; the crash test covers SQLite")
    app = make_app(PROPAGATE_EXCEPTIONS=False)
    pool = ThreadPoolExecutor(1)
    with StatementGate(db_url) as gate:
        first = pool.submit(post_event, app.test_client(), "cut-key")
        # Its statement has written the record and waits at its event.
        assert wait_until(lambda: lock_waits(db_url) == 1, timeout=WAIT)
        # The server ends the backend (as a failover or an operator would),
        # mid-statement, before anything commits.
        gate.holder.execute(
            text("SELECT pg_terminate_backend(:pid)"), {"pid": gate.waiting_backend()}
        )
        answer = first.result(WAIT)
    pool.shutdown()
    assert answer.status_code == 503
    assert answer.mimetype == "application/problem+json"
    assert stored(app) == (0, [])

    retry = post_event(app.test_client(), "cut-key")
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry.headers
    assert stored(app) == (1, [("cut-key", COMPLETED)])


# -- racing requests with one key --------------------------------------------


class Paused:
    """Hold one thread's request after a write until ``release()`` (or only see it pass)."""

    def __init__(self, matches: Callable[[str], bool], *, hold: bool = True) -> None:
        self.matches = matches
        self.thread: int | None = None
        self.reached = threading.Event()
        self._go = threading.Event()
        if not hold:
            self._go.set()

    def __call__(self, step: str) -> None:
        mine = threading.get_ident() == self.thread
        if mine and not self.reached.is_set() and self.matches(step):
            self.reached.set()
            self._go.wait(WAIT)

    def release(self) -> None:
        self._go.set()


def start(pool: ThreadPoolExecutor, app: Flask, key: str, body: dict[str, Any], paused: Paused):
    """Send a request from a pool thread, to be held where ``paused`` says."""
    ready = threading.Event()

    def send() -> Any:
        paused.thread = threading.get_ident()
        ready.set()
        return post_event(app.test_client(), key, body)

    future = pool.submit(send)
    assert ready.wait(WAIT)
    return future


def lock_waits(db_url: str) -> int:
    """How many backends of this database wait for a lock (PostgreSQL)."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return conn.scalar(
                text(
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                    "WHERE NOT l.granted AND a.datname = current_database()"
                )
            )
    finally:
        engine.dispose()


def hold_the_first_and_race(
    app: Flask, db_url: str, key: str, second_body: dict[str, Any]
) -> tuple[Future[Any], Future[Any]]:
    """Hold a first request on its uncommitted record; start a second that meets it."""
    if db_url.startswith("postgresql"):
        return _race_inside_the_statement(app, db_url, key, second_body)
    # The first request holds its record's row, written but not committed
    # (with the writers' turn, held since its event's insert).
    first_paused = Paused(is_record_write)
    # The second meets the first either way /api/events may go
    # (speculative): it reads the key first, its first use of a connection,
    # and gives that connection back; or it runs the view at once and asks
    # for the writers' turn to write its event.
    second_met = Paused(lambda _what: True, hold=False)
    take_turn = database._LazyTurn.take

    def taking_turn(turn: Any) -> None:
        second_met("turn")
        take_turn(turn)

    pool = ThreadPoolExecutor(2)
    with (
        after_each_write(first_paused),
        on_checkin(app, lambda: second_met("checkin")),
        patch.object(database._LazyTurn, "take", taking_turn),
    ):
        first = start(pool, app, key, BODY, first_paused)
        assert first_paused.reached.wait(WAIT)
        second = start(pool, app, key, second_body, second_met)
        # The second request read the key while the first's record was
        # uncommitted (it saw nothing, and goes on to write its own), or it
        # waits for the first's turn to end.
        assert second_met.reached.wait(WAIT)
        first_paused.release()
        first.result(WAIT)
        second.result(WAIT)
    pool.shutdown()
    return first, second


def _race_inside_the_statement(
    app: Flask, db_url: str, key: str, second_body: dict[str, Any]
) -> tuple[Future[Any], Future[Any]]:
    pool = ThreadPoolExecutor(2)
    with StatementGate(db_url) as gate:
        first = pool.submit(post_event, app.test_client(), key, BODY)
        # The first's statement has written its record and waits at its event.
        assert wait_until(lambda: lock_waits(db_url) == 1, timeout=WAIT)
        second = pool.submit(post_event, app.test_client(), key, second_body)
        # The second read the key (nothing committed: it saw nothing) or,
        # speculative, did not; it ran the view, and its statement waits on
        # the first's row in the record's unique index.
        assert wait_until(lambda: lock_waits(db_url) == 2, timeout=WAIT)
        gate.release()
        first.result(WAIT)
        second.result(WAIT)
    pool.shutdown()
    return first, second


def test_racing_request_with_the_same_body_replays_after_the_first_commits(app, db_url):
    first, second = hold_the_first_and_race(app, db_url, "race-key", BODY)
    assert first.result().status_code == 201
    assert "Idempotent-Replayed" not in first.result().headers
    replay = second.result()
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_data() == first.result().get_data()
    assert stored(app) == (1, [("race-key", COMPLETED)])


def test_racing_request_with_another_body_gets_422_after_the_first_commits(app, db_url):
    first, second = hold_the_first_and_race(app, db_url, "race-key", OTHER_BODY)
    assert first.result().status_code == 201
    refused = second.result()
    assert refused.status_code == 422
    assert refused.mimetype == "application/problem+json"
    assert refused.get_json()["type"] == "/problems/idempotency-key-reused"
    assert stored(app) == (1, [("race-key", COMPLETED)])


def test_waiting_past_the_lock_timeout_is_409_with_retry_after(make_app, db_url):
    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite has no lock per key: a writer waits for the database (busy timeout)")
    app = make_app(IDEMPOTENCY_LOCK_TIMEOUT_SECONDS=0.05)
    pool = ThreadPoolExecutor(1)
    with StatementGate(db_url) as gate:
        first = pool.submit(post_event, app.test_client(), "slow-key")
        assert wait_until(lambda: lock_waits(db_url) == 1, timeout=WAIT)
        # The first holds its uncommitted record for as long as this takes.
        waited = post_event(app.test_client(), "slow-key")
        gate.release()
        assert first.result(WAIT).status_code == 201
    pool.shutdown()

    assert waited.status_code == 409
    assert waited.mimetype == "application/problem+json"
    assert waited.get_json()["type"] == "/problems/idempotency-key-in-use"
    assert waited.headers["Retry-After"] == "1"
    # Its event went with its transaction; its retry replays the first's answer.
    assert stored(app) == (1, [("slow-key", COMPLETED)])
    retry = post_event(app.test_client(), "slow-key")
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_data() == first.result().get_data()
