"""Data access for stored events, shared by the webhook and API surfaces."""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.engine import Connection

from .database import insert_ignoring_conflicts
from .extensions import db
from .models import Event
from .processing import outbox

_t = Event.__table__

# Header values that authenticate or sign a request are never stored: these
# names, any name matching SECRET_NAME (X-Api-Key, X-Auth-Token,
# X-Gitlab-Token, X-Shopify-Hmac-Sha256, ...), and each provider's own.
ALWAYS_REDACTED = frozenset(
    {"authorization", "cookie", "set-cookie", "proxy-authorization", "x-amz-security-token"}
)
SECRET_NAME = re.compile(
    r"token|secret|signature|passw|api[-_]?key|access[-_]?key|auth|session|cookie|credential|hmac",
    re.IGNORECASE,
)
REDACTED = "[redacted]"


def is_secret_header(name: str) -> bool:
    """Tell whether a header's name says its value may carry a credential."""
    return name.lower() in ALWAYS_REDACTED or SECRET_NAME.search(name) is not None


def redact_headers(
    headers: Iterable[tuple[str, str]], secret_names: Iterable[str] = ()
) -> list[list[str]]:
    """Return the headers as [name, value] pairs with secret-bearing values redacted."""
    listed = {name.lower() for name in secret_names}
    return [
        [name, REDACTED if name.lower() in listed or is_secret_header(name) else value]
        for name, value in headers
    ]


def insert_event(values: dict[str, Any], connection: Connection | None = None) -> int | None:
    """Insert an event in the current transaction; None if (source, dedup_key) exists.

    The transaction is the session's, or that of ``connection`` when given.
    A fresh event gets its consumers' delivery rows in the same transaction
    (the outbox).
    """
    connection = connection or db.session.connection()
    event_id = connection.execute(insert_statement(), values).scalar()
    if event_id is not None:
        outbox.enqueue(
            event_id,
            values["source"],
            values.get("event_type"),
            values["received_at"],
            connection,
        )
    return event_id


_INSERTS: dict[str, Any] = {}


def insert_statement() -> Any:
    """The event INSERT of the app's database: nothing on a taken key, else the new id."""
    # One statement per dialect, built once and run through a connection:
    # cheaper than building it, and than the ORM's execute.
    dialect = db.engine.dialect.name
    statement = _INSERTS.get(dialect)
    if statement is None:
        statement = insert_ignoring_conflicts(_t, ["source", "dedup_key"]).returning(_t.c.id)
        _INSERTS[dialect] = statement
    return statement


def get_event(event_id: int) -> Event | None:
    """Load one event by id."""
    return db.session.get(Event, event_id)


def to_json(event: Event, data: Any) -> dict[str, Any]:
    """The API's representation of an event."""
    return {
        "id": event.id,
        "type": event.event_type,
        "source": event.source,
        "data": data,
        "received_at": iso(event.received_at),
        "duplicate_count": event.duplicate_count,
    }


def iso(moment: datetime | None) -> str | None:
    """Format an aware UTC datetime as RFC 3339 with a Z."""
    if moment is None:
        return None
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


FIND_BY_KEY = select(_t.c.id, _t.c.fingerprint).where(
    _t.c.source == bindparam("b_source"), _t.c.dedup_key == bindparam("b_key")
)


def find_by_key(source: str, dedup_key: str, connection: Connection) -> Any:
    """Read the id and fingerprint of the event stored under (source, dedup_key).

    A lone read, on a connection of ``autocommit_connection()``.
    """
    params = {"b_source": source, "b_key": dedup_key}
    return connection.execute(FIND_BY_KEY, params).one_or_none()
