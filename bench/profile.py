"""Profile the API hot path in-process: ``python -m bench --profile``.

The app runs in this process (Flask's test client, no gunicorn) on a fresh,
migrated database, so pyinstrument sees every Python frame of a request:
authentication, the Idempotency-Key engine, the view, SQLAlchemy and the
driver. It also counts the SQL statements and commits each request sends.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from .scenarios import EVENT_BODY, GITHUB_BODY, WEBHOOK_CONFIG, _github_headers

RESULTS = Path(__file__).resolve().parent / "results"
REQUESTS = 1000


@contextlib.contextmanager
def _stderr_to_devnull() -> Iterator[None]:
    # The app logs a line per request; keep its cost, lose its noise.
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _statements(engine) -> dict[str, int]:
    """Count the statements and commits the app sends, at the driver.

    The hot paths run statements on the driver's own cursors, past
    SQLAlchemy's events, so the counting is the driver's: SQLite's trace
    callback, and psycopg's cursor and commit. A write run outside a
    transaction (autocommit) is a commit of its own. Only the requests'
    thread counts: the batches of the process's background writers (the
    redeliveries' bookkeeping) are not any one request's.
    """
    import threading

    counts = {"statements": 0, "commits": 0}
    requests_thread = threading.main_thread()

    def mine() -> bool:
        return threading.current_thread() is requests_thread

    def is_write(sql: object) -> bool:
        return not str(sql).lstrip()[:6].upper().startswith("SELECT")

    if engine.dialect.name == "sqlite":
        from sqlalchemy import event

        def on_connect(dbapi_connection, _record) -> None:
            def trace(sql: str) -> None:
                if not mine():
                    return
                verb = sql.lstrip()[:8].upper()
                if verb.startswith(("BEGIN", "PRAGMA", "SAVEPOINT", "RELEASE", "ROLLBACK")):
                    return
                if verb.startswith(("COMMIT", "END")):
                    counts["commits"] += 1
                    return
                counts["statements"] += 1
                if not dbapi_connection.in_transaction and is_write(verb):
                    counts["commits"] += 1

            dbapi_connection.set_trace_callback(trace)

        event.listen(engine, "connect", on_connect)
        engine.dispose()  # the pooled connections are made again, traced
        return counts

    import psycopg

    execute, executemany, commit = (
        psycopg.Cursor.execute,
        psycopg.Cursor.executemany,
        psycopg.Connection.commit,
    )

    def counted_execute(cursor, query, *args, **kwargs):
        if mine():
            counts["statements"] += 1
            counts["commits"] += cursor.connection.autocommit and is_write(query)
        return execute(cursor, query, *args, **kwargs)

    def counted_executemany(cursor, query, params_seq, *args, **kwargs):
        params_seq = list(params_seq)
        if mine():
            counts["statements"] += len(params_seq)
            counts["commits"] += cursor.connection.autocommit
        return executemany(cursor, query, params_seq, *args, **kwargs)

    def counted_commit(connection):
        counts["commits"] += mine()
        return commit(connection)

    psycopg.Cursor.execute = counted_execute
    psycopg.Cursor.executemany = counted_executemany
    psycopg.Connection.commit = counted_commit
    return counts


def _profile_db(db: str, url: str, out_dir: Path) -> None:
    from flask_migrate import upgrade
    from pyinstrument import Profiler

    from webhook_receiver import create_app
    from webhook_receiver.extensions import db as sa
    from webhook_receiver.inbox import duplicates

    token = secrets.token_hex(24)
    app = create_app(
        {
            "SECRET_KEY": secrets.token_hex(32),
            "SQLALCHEMY_DATABASE_URI": url,
            "RECEIVER_CONFIG": {
                "clients": {"bench": {"token": token}},
                "sources": _sources(),
            },
        }
    )
    with app.app_context():
        upgrade()
        engine = sa.engine
    client = app.test_client()

    def post(key: str) -> int:
        return client.post(
            "/api/events",
            data=EVENT_BODY,
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key},
        ).status_code

    def deliver(key: str) -> int:
        return client.post(
            "/webhooks/bench-github", data=GITHUB_BODY, headers=_github_headers(key)
        ).status_code

    counts = _statements(engine)
    stamp = f"{datetime.now(UTC):%Y%m%d-%H%M%S}"
    with _stderr_to_devnull():
        for i in range(100):  # warm caches, pools and compiled statements
            assert post(f"warm-{i}") == 201
        for i in range(100):
            assert deliver(f"warm-{i}") == 200
        for kind, send, keys in (
            ("unique", post, [f"unique-{i}" for i in range(REQUESTS)]),
            ("replay", post, [f"unique-{i % 100}" for i in range(REQUESTS)]),
            ("webhook-unique", deliver, [f"unique-{i}" for i in range(REQUESTS)]),
            ("webhook-redelivery", deliver, [f"unique-{i % 100}" for i in range(REQUESTS)]),
        ):
            counts.update(statements=0, commits=0)
            profiler = Profiler(interval=0.0005)
            profiler.start()
            for key in keys:
                assert send(key) in (200, 201)
            profiler.stop()
            per = {k: v / len(keys) for k, v in counts.items()}
            text = profiler.output_text(unicode=True, color=False, show_all=False)
            path = out_dir / f"profile-{db}-{kind}-{stamp}.txt"
            path.write_text(text)
            summary = (
                f"{db} {kind}: {len(keys) / profiler.last_session.duration:.0f} req/s in-process, "
                f"{per['statements']:.1f} SQL statements and {per['commits']:.1f} commits "
                f"per request; profile in {path.relative_to(out_dir.parent.parent)}"
            )
            print(summary, flush=True)
    # The redeliveries still batched are written before the database goes.
    app.extensions[duplicates.EXTENSION].close()
    with app.app_context():
        sa.session.remove()
        sa.engine.dispose()


def _sources() -> dict:
    import tomllib

    return tomllib.loads(WEBHOOK_CONFIG)["sources"]


def profile(pg_url: str | None) -> int:
    """Profile unique and replayed POST /api/events on SQLite and, if given, PostgreSQL."""
    RESULTS.mkdir(exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="wr-profile-", dir=RESULTS))
    try:
        _profile_db("sqlite", f"sqlite:///{workdir / 'profile.sqlite3'}", RESULTS)
        if pg_url:
            from .run import postgresql_database

            with postgresql_database(pg_url) as url:
                _profile_db("postgresql", url, RESULTS)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0
