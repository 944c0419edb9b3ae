"""The baseline: a bare Flask view that does one plain INSERT and a commit.

It is what a request costs with none of the receiver's work (no
authentication, no Idempotency-Key engine, no JSON checks, no ORM session):
gunicorn, Flask's routing, one pooled connection, one ``INSERT ... ON
CONFLICT DO NOTHING`` into the same ``events`` table with the same indexes,
and one commit with the same durability settings. Served by gunicorn exactly
like ``wsgi:app``; the database URL comes from ``BENCH_DATABASE_URL``.

``/floor/api-unique`` is the same bare view sending the statements of a new
Idempotency-Key and nothing else: the event's INSERT and the record's
INSERT with its saved answer, as the app sends them while retries are rare
(``POST /api/events`` is speculative: no read of the key first): on SQLite
one transaction of the two, on PostgreSQL one autocommitted statement (the
event written only if the record was). It shows what the statements alone
cost, whatever code sends them.
"""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime

from flask import Flask, Response, request
from sqlalchemy import create_engine, event, text

from webhook_receiver.config import database_uri
from webhook_receiver.database import SQLITE_BUSY_TIMEOUT_MS, engine_options

_INSERT = text(
    "INSERT INTO events (source, dedup_key, event_type, fingerprint, content_type, body,"
    " headers, meta, received_at)"
    " VALUES ('bench:baseline', :key, 'bench', :fp, 'application/json', :body,"
    " '[]', '{}', :now)"
    " ON CONFLICT (source, dedup_key) DO NOTHING"
)


_INSERT_RECORD = text(
    "INSERT INTO idempotency_records (client, key, fingerprint, method, path, state,"
    " created_at, expires_at, completed_at, response_status, response_headers, response_body)"
    " VALUES ('bench', :key, :fp, 'POST', '/floor/api-unique', 'completed', :now, :now, :now,"
    " 201, '[]', :body)"
    " ON CONFLICT (client, key) DO NOTHING RETURNING id"
)


def _driver_sql(sql: str, dialect: str) -> str:
    # sqlite3 takes :name as it is; psycopg wants %(name)s.
    return sql if dialect == "sqlite" else re.sub(r"(?<!\w):(\w+)", r"%(\1)s", sql)


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
    app.extensions["engine"] = engine  # for whoever disposes of it
    postgresql = engine.dialect.name == "postgresql"
    floor_sql = [_driver_sql(str(t), engine.dialect.name) for t in (_INSERT, _INSERT_RECORD)]
    if postgresql:
        # The record, then the event only if the record went in: one statement.
        event_if_recorded = (
            floor_sql[0]
            .replace(" VALUES (", " SELECT ", 1)
            .replace(
                ") ON CONFLICT (source, dedup_key) DO NOTHING",
                " WHERE EXISTS (SELECT 1 FROM recorded) ON CONFLICT (source, dedup_key) DO NOTHING",
            )
        )
        one_statement = f"WITH recorded AS ({floor_sql[1]}) {event_if_recorded}"

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

    @app.post("/floor/api-unique")
    def floor_api_unique() -> Response:
        """A new Idempotency-Key's statements: the event and its record."""
        body = request.get_data()
        values = {
            "key": request.headers["Idempotency-Key"],
            "fp": "0" * 64,
            "body": body,
            "now": datetime.now(UTC).replace(tzinfo=None),
        }
        # Straight on the driver, the cheapest way to send them.
        pooled = engine.raw_connection()
        try:
            driver = pooled.driver_connection
            cursor = driver.cursor()
            if postgresql:
                driver.autocommit = True  # the one statement is its own transaction
                cursor.execute(one_statement, values)
                driver.autocommit = False
            else:
                cursor.execute(floor_sql[0], values)  # the driver begins the transaction
                cursor.execute(floor_sql[1], values).fetchone()
                pooled.commit()
            cursor.close()
        finally:
            pooled.close()
        return Response('{"ok":true}', status=201, mimetype="application/json")

    return app


app = create_app()
