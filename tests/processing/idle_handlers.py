"""Handlers that sit idle in Python with their transaction open (``handlers = [...]``).

On PostgreSQL each first sets a short ``idle_in_transaction_session_timeout``
for its own transaction, so that its idle wait outlasts it and the server
ends the session. SQLite has no such timeout: the same wait is harmless.
``terminated`` instead has its session ended by another connection while it
waits (``pg_terminate_backend``, what a server shutting down does to every
session): the database going away, not the handler's fault.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from sqlalchemy import text

from webhook_receiver.extensions import db
from webhook_receiver.processing import handler

IDLE_TIMEOUT_MS = 200
IDLE_SECONDS = 0.6


def _idle(session: Any) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = {IDLE_TIMEOUT_MS}"))
    time.sleep(IDLE_SECONDS)


@handler(source="shop", event_type="order.idle", name="idle_then_query", max_attempts=2)
def idle_then_query(event: Any, session: Any) -> None:
    _idle(session)
    session.execute(text("SELECT 1"))


@handler(source="shop", event_type="order.idle", name="idle_then_return", max_attempts=2)
def idle_then_return(event: Any, session: Any) -> None:
    # The next statement is the worker's own (marking the delivery done).
    _idle(session)


@handler(source="shop", event_type="order.terminated", name="terminated", max_attempts=1)
def terminated(event: Any, session: Any) -> None:
    if session.get_bind().dialect.name != "postgresql":
        return
    pid = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
    url = db.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as other:
        # Returns once the session has ended (or after 10 s).
        other.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
    session.execute(text("SELECT 1"))
