"""A handler whose own query always times out, loaded through ``handlers = [...]``.

PostgreSQL: a query longer than the statement timeout. SQLite has no
statement timeout; its equivalent is a lock the query can never get: a
write on a second connection, which waits for the write lock that the
handler's own transaction holds until the busy timeout refuses it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from webhook_receiver.extensions import db
from webhook_receiver.processing import handler


@handler(source="shop", event_type="order.refunded", name="stuck", max_attempts=2)
def wait_past_the_timeout(event: Any, session: Any) -> None:
    if session.get_bind().dialect.name == "sqlite":
        with db.engine.begin() as other:
            other.execute(
                text("UPDATE events SET event_type = event_type WHERE id = :id"), {"id": event.id}
            )
    else:
        session.execute(text("SELECT pg_sleep(30)"))
