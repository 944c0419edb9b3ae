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
    from sqlalchemy import event

    counts = {"statements": 0, "commits": 0}

    def on_execute(*_args) -> None:
        counts["statements"] += 1

    def on_commit(*_args) -> None:
        counts["commits"] += 1

    event.listen(engine, "before_cursor_execute", on_execute)
    event.listen(engine, "commit", on_commit)
    return counts


def _profile_db(db: str, url: str, out_dir: Path) -> None:
    from flask_migrate import upgrade
    from pyinstrument import Profiler

    from webhook_receiver import create_app
    from webhook_receiver.extensions import db as sa

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
