"""When the database cannot be reached: /readyz and every write answer 503, never 2xx."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from webhook_receiver.models import Event, IdempotencyRecord
from webhook_receiver.processing.worker import Worker

from .conftest import ACME_TOKEN, CLIENTS, _migrate, bearer
from .databases import read_only, throwaway_postgresql
from .helpers import count, count_at
from .helpers import signing as s
from .helpers.signing import delivery_for
from .servers import free_port, gunicorn, wait_until

CONFIG_TOML = f'[clients.acme]\ntoken = "{ACME_TOKEN}"\n'
EVENT = {"type": "order.created", "data": {"order": 7}}


def unreachable_urls(db_url: str, tmp_path) -> list[str]:
    """URLs of the same kind as ``db_url`` behind which no database answers."""
    if db_url.startswith("sqlite"):
        (tmp_path / "a-directory").mkdir()
        # Another program's file at the path: SQLITE_NOTADB, a damaged database.
        (tmp_path / "not-a-database").write_bytes(b"not a database, whatever it was" * 200)
        return [
            f"sqlite:///{tmp_path / 'missing-dir' / 'db.sqlite3'}",
            f"sqlite:///{tmp_path / 'a-directory'}",
            f"sqlite:///{tmp_path / 'not-a-database'}",
        ]
    # Nothing listens on a port that was free a moment ago.
    return [f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"]


@pytest.fixture
def down_clients(make_app, db_url, tmp_path):
    """Test clients of apps whose database cannot be reached, with every provider's source."""
    return [
        make_app(
            {"clients": CLIENTS, "sources": s.SOURCES}, SQLALCHEMY_DATABASE_URI=url
        ).test_client()
        for url in unreachable_urls(db_url, tmp_path)
    ]


def assert_unavailable(response) -> None:
    assert response.status_code == 503, response.get_data(as_text=True)
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == "/problems/database-unavailable"
    assert int(response.headers["Retry-After"]) >= 1


def test_readyz_is_503_problem_json_when_the_database_is_unreachable(down_clients):
    for client in down_clients:
        assert_unavailable(client.get("/readyz"))
        # Liveness does not depend on the database.
        assert client.get("/healthz").status_code == 200


def test_post_event_is_503_when_the_database_is_unreachable(down_clients):
    for client in down_clients:
        response = client.post(
            "/api/events", json=EVENT, headers={**bearer(), "Idempotency-Key": "down-1"}
        )
        assert_unavailable(response)


def test_get_event_is_503_when_the_database_is_unreachable(down_clients):
    for client in down_clients:
        assert_unavailable(client.get("/api/events/1", headers=bearer()))


def test_refusals_that_need_no_database_still_come_first(down_clients):
    # Authentication and the key's syntax are checked before the database.
    for client in down_clients:
        assert client.post("/api/events", json=EVENT).status_code == 401
        response = client.post("/api/events", json=EVENT, headers=bearer())
        assert response.get_json()["type"] == "/problems/idempotency-key-missing"


def test_no_api_or_webhook_write_answers_2xx_when_the_database_is_unreachable(down_clients):
    swept = set()
    for client in down_clients:
        app = client.application
        adapter = app.url_map.bind("localhost")
        for rule in app.url_map.iter_rules():
            if "POST" not in rule.methods or not rule.rule.startswith(("/api/", "/webhooks/")):
                continue
            if "source_name" in rule.arguments:
                # A valid delivery to each configured source: an unknown one
                # would be refused (404) before the database is touched.
                for n, name in enumerate(s.SOURCES):
                    body, headers = delivery_for(name, f"sweep-{n}")
                    path = adapter.build(rule.endpoint, {"source_name": name}, method="POST")
                    response = client.post(path, data=body, headers=headers)
                    assert_unavailable(response)
                    swept.add(name)
                continue
            path = adapter.build(rule.endpoint, dict.fromkeys(rule.arguments, 1), method="POST")
            response = client.post(
                path, json=EVENT, headers={**bearer(), "Idempotency-Key": "sweep"}
            )
            assert not 200 <= response.status_code < 400, (rule.rule, response.status_code)
    assert swept == set(s.SOURCES)


# -- a real outage under gunicorn ----------------------------------------------


@pytest.fixture
def throwaway_pg() -> Iterator[tuple[str, Engine, str]]:
    """A migrated PostgreSQL database of this test's own, and an admin engine to cut it off."""
    with throwaway_postgresql("wr_outage") as (url, admin, name):
        _migrate(url)
        yield url, admin, name


def cut_off(admin: Engine, name: str) -> None:
    """Make one database unreachable: refuse new connections and end the open ones."""
    with admin.connect() as conn:
        conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
        conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = :name AND pid <> pg_backend_pid()"
            ),
            {"name": name},
        )


def restore(admin: Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))


def test_real_postgresql_outage_under_gunicorn_answers_503_then_recovers(throwaway_pg, tmp_path):
    url, admin, name = throwaway_pg
    auth = {"Authorization": f"Bearer {ACME_TOKEN}"}

    def post(key: str) -> requests.Response:
        return requests.post(
            server.url + "/api/events",
            json=EVENT,
            headers={**auth, "Idempotency-Key": key},
            timeout=10,
        )

    with gunicorn(url, CONFIG_TOML, tmp_path, workers=2) as server:
        before = post("before")
        assert before.status_code == 201
        assert requests.get(server.url + "/readyz", timeout=5).status_code == 200

        cut_off(admin, name)
        try:
            # Pooled connections were killed under the workers, and new ones
            # are refused: both must come out as 503, never as a 2xx.
            for i in range(6):
                for response in (
                    post(f"during-{i}"),
                    post("before"),
                    requests.get(server.url + "/readyz", timeout=5),
                    requests.get(server.url + before.headers["Location"], headers=auth, timeout=5),
                ):
                    assert response.status_code == 503, response.text
                    assert response.headers["Content-Type"] == "application/problem+json"
                    assert response.json()["type"] == "/problems/database-unavailable"
                    assert response.headers["Retry-After"]
            assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
        finally:
            restore(admin, name)

        assert wait_until(
            lambda: requests.get(server.url + "/readyz", timeout=5).status_code == 200, timeout=10
        )
        # A request refused during the outage left nothing behind: its retry executes.
        retried = post("during-0")
        assert retried.status_code == 201
        assert "Idempotent-Replayed" not in retried.headers
        replay = post("before")
        assert replay.status_code == 201
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.json() == before.json()
        log = server.log()

    assert "database unavailable" in log
    assert count_at(url) == 2


def _waiting_on_a_lock(admin: Engine, name: str) -> list[int]:
    with admin.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT pid FROM pg_stat_activity "
                    "WHERE datname = :name AND wait_event_type = 'Lock'"
                ),
                {"name": name},
            ).scalars()
        )


def test_postgresql_lost_mid_transaction_then_the_first_retry_executes_once(throwaway_pg, tmp_path):
    """The request's transaction died with the database, its claim with it.

    The claim, the event and the saved response are one transaction
    (docs/idempotency.md): nothing was committed, so nothing is left to
    release or to wait out, and the first request once the database is back
    executes, once.
    """
    url, admin, name = throwaway_pg
    auth = {"Authorization": f"Bearer {ACME_TOKEN}"}

    def post() -> requests.Response:
        return requests.post(
            server.url + "/api/events",
            json=EVENT,
            headers={**auth, "Idempotency-Key": "mid-flight"},
            timeout=10,
        )

    locker = create_engine(url)
    with gunicorn(url, CONFIG_TOML, tmp_path, workers=2) as server:
        lock = locker.connect()
        lock.exec_driver_sql("BEGIN")
        lock.exec_driver_sql("LOCK TABLE events IN SHARE MODE")
        with ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(post)
            # The key was read (nothing there) and the view waits on its INSERT.
            assert wait_until(lambda: _waiting_on_a_lock(admin, name), timeout=10)
            with admin.connect() as conn:
                conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
                # The waiting worker's connection goes first, so that the lock
                # holder's end cannot let its INSERT through.
                for pid in _waiting_on_a_lock(admin, name):
                    conn.execute(text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid})
            cut_off(admin, name)
            response = first.result(timeout=15)
        lock.invalidate()
        restore(admin, name)

        assert response.status_code == 503, response.text
        assert response.json()["type"] == "/problems/database-unavailable"

        answer = post()
        assert answer.status_code == 201, answer.text
        assert "Idempotent-Replayed" not in answer.headers
        replay = post()
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.json() == answer.json()
    locker.dispose()

    assert count_at(url) == 1


def test_writes_to_a_read_only_database_are_503_and_never_2xx(make_app, db_url) -> None:
    # A standby after a failover: PostgreSQL refuses each write with
    # read_only_sql_transaction, which psycopg files under InternalError
    # (it was a 500 "internal-error"); SQLite's read-only file is an
    # OperationalError. Either way the sender must retry later.
    config = {"clients": CLIENTS, "sources": {"stripe-live": s.SOURCES["stripe-live"]}}
    app = make_app(config, **read_only(db_url))
    client = app.test_client()
    body = b'{"id":"evt_read_only","type":"charge.succeeded"}'
    writes = [
        client.post(
            "/api/events",
            data=b'{"type":"t","data":{}}',
            headers={
                **bearer(),
                "Idempotency-Key": "read-only-1",
                "Content-Type": "application/json",
            },
        ),
        client.post(
            "/webhooks/stripe-live", data=body, headers=s.stripe_signed(body, int(time.time()))
        ),
    ]
    for response in writes:
        assert response.status_code == 503, response.get_data(as_text=True)
        assert response.mimetype == "application/problem+json"
        assert response.get_json()["type"] == "/problems/database-unavailable"
        assert response.headers["Retry-After"]
    writable = make_app(config)
    assert count(writable, Event) == count(writable, IdempotencyRecord) == 0


def test_a_statement_past_a_database_limit_is_no_outage(make_app):
    # PostgreSQL's unique index on (source, dedup_key) holds at most 2704
    # bytes a row: a long key of four-byte characters under a long source
    # name went past it within Message.build's character limits. The
    # error (SQLSTATE 54000) is an OperationalError to psycopg, and was taken
    # for the database being away: a 503, a broker batch backed off and
    # retried for ever rather than stored one by one. SQLite stores it.
    from sqlalchemy.exc import DBAPIError

    from webhook_receiver import inbox
    from webhook_receiver.database import is_unavailable

    four_bytes = "".join(chr(0x10000 + 7919 * i % 0xFFFFF) for i in range(1, 709))
    # Built directly: Message.build now refuses it (the test is of the error).
    message = inbox.Message(
        source=four_bytes[:196], dedup_key=four_bytes[196:], fingerprint="f" * 64, body=b"{}"
    )
    app = make_app({"clients": CLIENTS, "sources": {}})
    with app.app_context():
        try:
            outcome = inbox.receive(message)
        except DBAPIError as exc:
            assert not is_unavailable(exc), exc
        else:
            assert isinstance(outcome, inbox.Accepted)


def _lowered(engine: Engine, limit: int, value: int) -> None:
    """Lower ``limit`` (sqlite3.SQLITE_LIMIT_...) on every new SQLite connection of ``engine``."""
    import sqlite3

    from sqlalchemy import event

    def lower(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        dbapi_connection.setlimit(limit, value)

    event.listen(engine, "connect", lower)
    engine.dispose()  # the pooled connections, opened before, go


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_sqlite_statement_past_one_of_its_limits_is_no_outage(make_app):
    # SQLite files what a faulty statement gets (SQLITE_ERROR: too many SQL
    # variables, too many terms in a compound SELECT) under OperationalError,
    # beside a locked or unreachable database, and every OperationalError was
    # taken for the database being away: a 503 for ever, a broker batch
    # backed off and retried for ever. A SQLite built with fewer variables a
    # statement than the batch's chunk (999 before SQLite 3.32; 32,766 since,
    # which the chunks keep within) refused every batch of more than 90
    # events so. Now told by the error's code: a faulty statement, so a
    # broker batch is stored one message at a time (each within the limit).
    import sqlite3

    from sqlalchemy.exc import DBAPIError

    from webhook_receiver import inbox
    from webhook_receiver.brokers import batch as broker_batch
    from webhook_receiver.database import is_unavailable
    from webhook_receiver.extensions import db

    from .helpers import RABBIT_SOURCE
    from .inbox.test_positions import _config, message

    app = make_app(_config())
    with app.app_context():
        _lowered(db.engine, sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
        messages = [message(f"k{n}") for n in range(100)]  # 100 rows of 11 values
        with pytest.raises(DBAPIError) as raised:
            inbox.receive_many(messages)
        assert raised.value.orig.sqlite_errorname == "SQLITE_ERROR"
        assert "too many SQL variables" in str(raised.value.orig)
        assert not is_unavailable(raised.value)
        verdicts = broker_batch.store(
            RABBIT_SOURCE, broker_batch.Prepared(messages, [None] * len(messages))
        )
        assert [v.action for v in verdicts] == ["ack"] * len(messages)
        with db.engine.connect() as conn, pytest.raises(DBAPIError) as raised:
            conn.exec_driver_sql("SELECT 1" + " UNION ALL SELECT 1" * 600)
        assert "too many terms in compound SELECT" in str(raised.value.orig)
        assert not is_unavailable(raised.value)
        # SQLITE_TOOBIG is a DataError: never taken for an outage.
        _lowered(db.engine, sqlite3.SQLITE_LIMIT_LENGTH, 4096)
        with pytest.raises(DBAPIError) as raised:
            inbox.receive(message("big", body=b"x" * 5000))
        assert raised.value.orig.sqlite_errorname == "SQLITE_TOOBIG"
        assert not is_unavailable(raised.value)


def test_a_sqlite_database_that_cannot_be_used_now_is_an_outage(tmp_path):
    # What the codes say is the database, not the statement, stays an
    # outage: a write lock held past the busy timeout, a read-only file, a
    # file that cannot be opened, a full database; and the writers' turn
    # past the busy timeout, an error of the driver's class without a code.
    import sqlite3

    from sqlalchemy.exc import DBAPIError

    from webhook_receiver.database import _locked, is_unavailable

    path = tmp_path / "db.sqlite3"
    with sqlite3.connect(path) as setup:
        setup.execute("CREATE TABLE t (v TEXT)")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    cases = {
        "SQLITE_BUSY": (f"sqlite:///{path}", {"timeout": 0}, "INSERT INTO t VALUES ('x')"),
        "SQLITE_READONLY": (
            f"sqlite:///file:{path}?mode=ro&uri=true",
            {},
            "INSERT INTO t VALUES ('x')",
        ),
        "SQLITE_CANTOPEN": (f"sqlite:///{tmp_path / 'missing' / 'db.sqlite3'}", {}, "SELECT 1"),
    }
    try:
        for name, (url, connect_args, statement) in cases.items():
            engine = create_engine(url, connect_args=connect_args)
            try:
                with pytest.raises(DBAPIError) as raised, engine.connect() as conn:
                    conn.exec_driver_sql(statement)
            finally:
                engine.dispose()
            assert raised.value.orig.sqlite_errorname.startswith(name), raised.value
            assert is_unavailable(raised.value), name
    finally:
        holder.rollback()
        holder.close()
    full = create_engine(f"sqlite:///{path}")
    try:
        with full.connect() as conn, pytest.raises(DBAPIError) as raised:
            conn.exec_driver_sql("PRAGMA max_page_count = 3")
            conn.exec_driver_sql("INSERT INTO t SELECT zeroblob(100000)")
    finally:
        full.dispose()
    assert raised.value.orig.sqlite_errorname == "SQLITE_FULL"
    assert is_unavailable(raised.value)
    assert is_unavailable(_locked())


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("damage", ["header", "table"])
def test_a_corrupt_sqlite_file_is_an_outage_and_no_message_is_dead_lettered(
    make_app, damage, caplog
):
    # A damaged file (a bad disk, a copy made while written, another
    # program's file at the path) answers every statement SQLITE_CORRUPT or
    # SQLITE_NOTADB. Those were taken for the statement's fault: each
    # request a 500 logged as a bug, and a broker batch stored one message
    # at a time, every one dead-lettered: the whole queue drained into its
    # dead letters while the database was being restored. It is the
    # database that cannot be used: a 503, and nothing settled.
    import sqlite3

    from sqlalchemy.exc import DBAPIError

    from webhook_receiver import inbox
    from webhook_receiver.brokers import batch as broker_batch
    from webhook_receiver.brokers.outage import Outage
    from webhook_receiver.database import is_unavailable
    from webhook_receiver.extensions import db

    from .helpers import RABBIT_SOURCE
    from .inbox.test_positions import _config, message

    app = make_app(_config())
    with app.app_context():
        inbox.receive(message("before"))
        path = db.engine.url.database
        db.engine.dispose()
    with sqlite3.connect(path) as setup:
        setup.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = setup.execute("PRAGMA page_size").fetchone()[0]
        # The events (the intakes' writes) and the deliveries with their
        # indexes (the worker's claims).
        roots = setup.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'events' "
            "OR (tbl_name = 'deliveries' AND rootpage > 0)"
        ).fetchall()
    with open(path, "r+b") as file:
        if damage == "header":
            file.write(b"not a database, whatever it was" * 4)
        else:
            for (root,) in roots:
                file.seek((root - 1) * page_size)
                file.write(b"\xff" * page_size)
    expected = {"header": "SQLITE_NOTADB", "table": "SQLITE_CORRUPT"}[damage]
    with app.app_context():
        with pytest.raises(DBAPIError) as raised:
            inbox.receive_many([message("k1"), message("k2")])
        assert raised.value.orig.sqlite_errorname == expected
        assert is_unavailable(raised.value)
        with pytest.raises(broker_batch.DatabaseUnavailable) as stopped:
            broker_batch.store(RABBIT_SOURCE, broker_batch.Prepared([message("k1")], [None]))
    # A consumer backs off through it, saying so as an ERROR each time.
    outage = Outage(RABBIT_SOURCE.name, "database")
    with caplog.at_level(logging.WARNING):
        outage.failed(stopped.value)
        outage.failed(stopped.value)
    assert len(damage_logged(caplog)) == 2
    assert_damage_logged(caplog, expected)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        response = app.test_client().post(
            "/api/events",
            data=b'{"type":"t","data":{}}',
            headers={
                **bearer(),
                "Idempotency-Key": "corrupt-1",
                "Content-Type": "application/json",
            },
        )
    assert_unavailable(response)
    # It will not pass by itself, as a lock or a restart does: an operator
    # must restore the file. A WARNING among the outages' said so to no one.
    assert_damage_logged(caplog, expected)
    caplog.clear()
    # The worker's claims meet it too: it logs and backs off, never crashes.
    worker = Worker(app)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    with caplog.at_level(logging.WARNING):
        thread.start()
        try:
            assert wait_until(lambda: damage_logged(caplog), timeout=10)
            assert thread.is_alive()
        finally:
            worker.stop()
            thread.join(30)
    assert not thread.is_alive()
    assert_damage_logged(caplog, expected)


def damage_logged(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "damaged" in r.getMessage()]


def assert_damage_logged(caplog, code: str) -> None:
    """An ERROR says the database is damaged, naming the driver's error, with no traceback."""
    records = damage_logged(caplog)
    assert records, [r.getMessage() for r in caplog.records]
    message = {"SQLITE_NOTADB": "file is not a database", "SQLITE_CORRUPT": "malformed"}[code]
    for record in records:
        assert record.levelno == logging.ERROR, record.getMessage()
        assert message in record.getMessage(), record.getMessage()
        assert record.exc_info is None


def test_a_damaged_postgresql_page_or_index_is_an_outage():
    # PostgreSQL's data_corrupted and index_corrupted (XX001, XX002), which
    # psycopg files under InternalError, as SQLite's damaged file above: a
    # server's files cannot be damaged from a test, so the driver's own
    # errors are classified as SQLAlchemy wraps them.
    import psycopg.errors
    from sqlalchemy.exc import DBAPIError

    from webhook_receiver.database import is_damaged, is_unavailable

    for error in (psycopg.errors.DataCorrupted, psycopg.errors.IndexCorrupted):
        wrapped = DBAPIError.instance("INSERT ...", {}, error("damaged"), psycopg.Error)
        assert wrapped.orig.sqlstate in {"XX001", "XX002"}
        assert is_unavailable(wrapped), error
        # Logged as an ERROR: no wait ends it.
        assert is_damaged(wrapped), error
    other = DBAPIError.instance(
        "INSERT ...", {}, psycopg.errors.InternalError_("other"), psycopg.Error
    )
    assert not is_unavailable(other)
    assert not is_damaged(other)
    # A server away is an outage that passes: a WARNING.
    refused = DBAPIError.instance(
        "SELECT 1", {}, psycopg.errors.AdminShutdown("terminating connection"), psycopg.Error
    )
    assert is_unavailable(refused) and not is_damaged(refused)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_readyz_says_a_damaged_database_must_be_restored(make_app, tmp_path, caplog):
    # A readiness probe is what an operator's alerting reads: "cannot be
    # reached" sends them to the network, where no wait or fix is.
    path = tmp_path / "not-a-database"
    path.write_bytes(b"not a database, whatever it was" * 200)
    app = make_app({"clients": CLIENTS}, SQLALCHEMY_DATABASE_URI=f"sqlite:///{path}")
    with caplog.at_level(logging.WARNING):
        response = app.test_client().get("/readyz")
    assert_unavailable(response)
    assert "damaged" in response.get_json()["detail"]
    assert "restore" in response.get_json()["detail"]
    assert_damage_logged(caplog, "SQLITE_NOTADB")
