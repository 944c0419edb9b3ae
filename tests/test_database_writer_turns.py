"""SQLite writers take turns through an flock beside the database (database.writer_turn)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from webhook_receiver import create_app, database
from webhook_receiver.extensions import db
from webhook_receiver.idempotency import decorator
from webhook_receiver.idempotency.persistence import records
from webhook_receiver.models import Event

from .conftest import CLIENTS, SECRET_KEY, bearer
from .helpers import count, post_webhook
from .helpers import signing as s

# Another process that holds the turn until told to let go.
HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""

# Another process that says whether it could take the turn right now.
PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free")
except BlockingIOError:
    print("taken")
"""


@pytest.fixture
def sqlite_app(_sqlite_template, tmp_path):
    """The app on a SQLite file of its own: turns are SQLite's alone."""
    path = tmp_path / "turns.sqlite3"
    shutil.copyfile(_sqlite_template, path)
    app = create_app(
        {
            "TESTING": True,
            "SECRET_KEY": SECRET_KEY,
            "SQLALCHEMY_DATABASE_URI": f"sqlite:///{path}",
            "DUPLICATE_FLUSH_SECONDS": 0,
            "RECEIVER_CONFIG": {"sources": s.SOURCES, "clients": CLIENTS},
        }
    )
    yield app
    with app.app_context():
        db.session.remove()
        db.engine.dispose()


def lock_path(app) -> str:
    with app.app_context():
        return str(db.engine.url.database) + "-writers.lock"


@contextmanager
def turn_held_elsewhere(path: str):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.communicate("\n", timeout=10)


def probe(path: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", PROBE, path], capture_output=True, text=True, check=True
    ).stdout.strip()


def deliver(client, event_id: str):
    event = {"id": event_id, "type": "invoice.paid", "data": {}}
    return post_webhook(client, "stripe-live", *s.stripe_delivery(event))


def test_a_write_waits_for_the_turn_and_gives_up_as_a_locked_database(sqlite_app, monkeypatch):
    app, client = sqlite_app, sqlite_app.test_client()
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 300)
    with turn_held_elsewhere(lock_path(app)):
        # SQLite itself is not locked: only the turn held elsewhere stops it.
        refused = deliver(client, "evt_1")
        assert refused.status_code == 503
        assert refused.json["type"].endswith("/problems/database-unavailable")
        assert count(app) == 0
        # Reads need no turn.
        assert client.get("/readyz").status_code == 200
    assert deliver(client, "evt_1").status_code == 200
    assert count(app) == 1
    assert probe(lock_path(app)) == "free"


def test_a_turn_inside_a_turn_is_the_same_turn(sqlite_app):
    app = sqlite_app
    path = lock_path(app)
    with app.app_context():
        with database.writer_turn():
            with database.writer_turn():
                assert probe(path) == "taken"
            # Leaving the inner block does not end the outer turn.
            assert probe(path) == "taken"
        assert probe(path) == "free"


def test_a_write_inside_a_turn_goes_through(make_app, db_url, tmp_path):
    # A receipt in a turn already held (SQLite) or with no turn to take
    # (PostgreSQL, where no lock file appears).
    app = make_app({"sources": s.SOURCES})
    with app.app_context():
        with database.writer_turn():
            assert deliver(app.test_client(), "evt_1").status_code == 200
    assert count(app) == 1
    locks = list(Path(tmp_path).glob("*-writers.lock"))
    assert len(locks) == (1 if db_url.startswith("sqlite") else 0)


def test_threads_of_one_process_take_turns_too(sqlite_app, monkeypatch):
    # A request and the duplicates' batch writer share the process's flock.
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 300)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with sqlite_app.app_context(), database.writer_turn():
            held.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        with sqlite_app.app_context(), pytest.raises(OperationalError):
            with database.writer_turn():
                pass
    finally:
        done.set()
        holder.join(10)
    with sqlite_app.app_context(), database.writer_turn():
        assert probe(lock_path(sqlite_app)) == "taken"


def test_an_api_request_without_a_turn_frees_its_key(sqlite_app, monkeypatch):
    # The key is read (free), then the transaction that would claim it
    # cannot get its turn: the answer is a 503, nothing was claimed, and the
    # retry runs.
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 300)
    # The view is speculative: it reads the key first only once retries are
    # common, which depends on what ran before in this process. Read first.
    monkeypatch.setattr(decorator.TakenKeys, "read_first", lambda _self: True)
    client = sqlite_app.test_client()
    real_find = records.find
    holding = ExitStack()

    def find_then_lose_the_turn(*args, **kwargs):
        outcome = real_find(*args, **kwargs)
        holding.enter_context(turn_held_elsewhere(lock_path(sqlite_app)))
        return outcome

    monkeypatch.setattr(records, "find", find_then_lose_the_turn)
    headers = {**bearer(), "Idempotency-Key": "order-1"}
    body = {"type": "order.created", "data": {"n": 1}}
    with holding:
        refused = client.post("/api/events", json=body, headers=headers)
    assert refused.status_code == 503
    monkeypatch.setattr(records, "find", real_find)
    assert client.post("/api/events", json=body, headers=headers).status_code == 201


def test_a_unit_of_work_takes_the_turn_at_its_first_statement_and_keeps_it_to_the_commit(
    sqlite_app,
):
    # Work before the first statement (parsing, hashing) keeps no other
    # writer waiting; from the first statement, reads included, the turn is
    # held, so a read is never followed by a write that another writer
    # overtook (SQLite cannot upgrade such a read: SQLITE_BUSY_SNAPSHOT).
    path = lock_path(sqlite_app)
    with sqlite_app.app_context():
        with database.unit_of_work() as session:
            assert probe(path) == "free"
            session.scalar(select(func.count()).select_from(Event))
            assert probe(path) == "taken"
            session.add(Event(**new_event("evt_first_statement")))
        assert probe(path) == "free"
        # A rolled-back unit of work lets go of its turn too.
        with pytest.raises(RuntimeError), database.unit_of_work() as session:
            session.scalar(select(func.count()).select_from(Event))
            assert probe(path) == "taken"
            raise RuntimeError("the view failed")
        assert probe(path) == "free"
        # A unit of work that continues a begun transaction takes it at once.
        db.session.scalar(select(func.count()).select_from(Event))
        with database.unit_of_work():
            assert probe(path) == "taken"
        assert probe(path) == "free"
    assert count(sqlite_app) == 1


def new_event(key: str) -> dict:
    return {
        "source": "stripe-live",
        "dedup_key": key,
        "fingerprint": "0" * 64,
        "body": b"{}",
        "headers": [],
        "meta": {},
        "received_at": datetime.now(UTC),
    }


def test_a_refused_begin_is_sqlalchemys_error_and_the_session_recovers(sqlite_app):
    """The BEGIN sent on the driver fails as SQLAlchemy's error, not sqlite3's, and rolls back."""
    with sqlite_app.app_context():
        with db.engine.connect() as conn:
            # A transaction the connection's owner did not close: the next BEGIN is refused.
            conn.connection.driver_connection.execute("BEGIN")
            with pytest.raises(OperationalError, match="within a transaction"):
                conn.begin()
        # The pool's reset rolled that connection back: a unit of work still commits.
        with database.unit_of_work():
            db.session.add(Event(**new_event("evt_after_refused_begin")))
    assert count(sqlite_app) == 1
