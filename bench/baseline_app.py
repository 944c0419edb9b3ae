"""The baseline: a bare Flask view that does one plain INSERT and a commit.

It is what a request costs with none of the receiver's work (no
authentication, no Idempotency-Key engine, no JSON checks, no ORM session):
gunicorn, Flask's routing, one pooled connection, one ``INSERT ... ON
CONFLICT DO NOTHING`` into the same ``events`` table with the same indexes,
and one commit with the same durability settings. Served by gunicorn exactly
like ``wsgi:app``; the database URL comes from ``BENCH_DATABASE_URL``.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime

from flask import Flask, Response, request
from sqlalchemy import create_engine, event, text

from webhook_receiver.config import database_uri
from webhook_receiver.database import SQLITE_BUSY_TIMEOUT_MS, engine_options

_INSERT = text(
    "INSERT INTO events (source, dedup_key, event_type, fingerprint, content_type, body,"
    " headers, meta, received_at, duplicate_count)"
    " VALUES ('bench:baseline', :key, 'bench', :fp, 'application/json', :body,"
    " '[]', '{}', :now, 0)"
    " ON CONFLICT (source, dedup_key) DO NOTHING"
)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # The same durability and concurrency settings as the app's engine.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


def create_app() -> Flask:
    """Build the bare app on ``BENCH_DATABASE_URL``."""
    uri = database_uri(os.environ["BENCH_DATABASE_URL"], "/nonexistent")
    engine = create_engine(uri, **engine_options(uri))
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    app = Flask(__name__)

    @app.post("/baseline")
    def insert() -> Response:
        """Store the body under the request's key with one INSERT and a commit."""
        body = request.get_data()
        key = request.headers["Idempotency-Key"]
        with engine.begin() as conn:
            conn.execute(
                _INSERT,
                {
                    "key": key,
                    "fp": "0" * 64,
                    "body": body,
                    "now": datetime.now(UTC).replace(tzinfo=None),
                },
            )
        return Response('{"ok":true}', status=201, mimetype="application/json")

    return app


app = create_app()
