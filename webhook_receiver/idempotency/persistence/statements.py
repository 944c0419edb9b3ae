"""The idempotency record's SQL: built once per dialect (or engine), run by records.py.

records.py holds the state machine and decides; these are its statements.
Building one per request cost more CPU than running it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, bindparam, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from ...database import insert_ignoring_conflicts
from ...database_driver import DriverStatement, PerEngine, insert_unless_stored
from ...models import IdempotencyRecord

IN_PROGRESS = "in_progress"
COMPLETED = "completed"

_t = IdempotencyRecord.__table__

UPSERT_COLUMNS = (
    *("client", "key", "fingerprint", "method", "path", "state", "lease_token"),
    *("lease_expires_at", "created_at", "expires_at", "completed_at", "response_status"),
    *("response_headers", "response_body"),
)


@dataclass(frozen=True)
class DriverStatements:
    """The record's statements on one engine's driver (each engine its own dialect)."""

    find: DriverStatement
    # Each column of ``LOOKUP``'s conversion of the value read.
    find_processors: list[Any]
    upsert: DriverStatement


def _driver_statements(engine: Engine) -> DriverStatements:
    """``LOOKUP`` and ``records.save_in_transaction``'s upsert on ``engine``'s driver.

    A replay is the read and nothing else: through SQLAlchemy's execution
    (a Connection, its result) the read cost about as much CPU as the rest
    of the replay; the upsert too cost more than its statement. The
    columns' own types still convert each value.
    """
    dialect = engine.dialect
    return DriverStatements(
        find=DriverStatement(LOOKUP, dialect),
        find_processors=[
            column.type.dialect_impl(dialect).result_processor(dialect, None)
            for column in LOOKUP.selected_columns
        ],
        upsert=DriverStatement(upsert_statement(dialect.name), dialect),
    )


# Built once per engine, on first use (the tests run apps on both databases).
driver_statements = PerEngine(_driver_statements).get


def upsert_statement(dialect: str, only_if: Any = None) -> Any:
    """``records.upsert``'s statement for this dialect; on PostgreSQL, only if ``only_if`` holds."""
    params = {name: bindparam(name, type_=_t.c[name].type) for name in UPSERT_COLUMNS}
    now = bindparam("b_now", type_=_t.c.expires_at.type)
    takeable = or_(
        _t.c.expires_at <= now, and_(_t.c.state == IN_PROGRESS, _t.c.lease_expires_at <= now)
    )
    if dialect == "sqlite":
        insert: Any = sqlite.insert(_t).values(params)
    else:
        # The statement sets the lock timeout itself (for the rest of the
        # transaction) before its row can meet an uncommitted one: a
        # SET LOCAL of its own would cost a round trip per new key.
        lock_timeout = func.set_config("lock_timeout", bindparam("b_lock_timeout"), True)
        row = select(*params.values()).where(lock_timeout.is_not(None))
        if only_if is not None:
            row = row.where(only_if)
        insert = postgresql.insert(_t).from_select(list(UPSERT_COLUMNS), row)
    statement = insert.on_conflict_do_update(
        index_elements=["client", "key"],
        set_={name: insert.excluded[name] for name in UPSERT_COLUMNS[2:]},
        where=takeable,
    ).returning(_t.c.id)
    return statement


LOOKUP = select(
    _t.c.id,
    _t.c.state,
    _t.c.fingerprint,
    _t.c.lease_expires_at,
    _t.c.expires_at,
    _t.c.response_status,
    _t.c.response_headers,
    _t.c.response_body,
).where(_t.c.client == bindparam("b_client"), _t.c.key == bindparam("b_key"))


CLAIM_COLUMNS = (
    "client",
    "key",
    "fingerprint",
    "method",
    "path",
    "state",
    "lease_token",
    "lease_expires_at",
    "created_at",
    "expires_at",
)


_CLAIMS: dict[str, Any] = {}


def claim_statement(dialect: str) -> Any:
    """The claim's INSERT (SQLite), or the read-or-insert statement (PostgreSQL)."""
    statement = _CLAIMS.get(dialect)
    if statement is not None:
        return statement
    row = {name: bindparam(name, type_=_t.c[name].type) for name in CLAIM_COLUMNS}
    if dialect == "sqlite":
        statement = insert_ignoring_conflicts(_t, ["client", "key"]).values(row).returning(_t.c.id)
    else:
        stored = LOOKUP.cte("stored")
        claimed = insert_unless_stored(_t, row, stored, ["client", "key"], "claimed")
        statement = select(
            *[select(column).scalar_subquery().label(column.name) for column in stored.c],
            select(claimed.c.id).scalar_subquery().label("claimed_id"),
        )
    _CLAIMS[dialect] = statement
    return statement


COMPLETE = (
    update(_t)
    .where(_t.c.id == bindparam("b_id"), _t.c.lease_token == bindparam("b_token"))
    .values(
        state=COMPLETED,
        lease_token=None,
        lease_expires_at=None,
        completed_at=bindparam("b_now", type_=_t.c.completed_at.type),
        response_status=bindparam("b_status", type_=_t.c.response_status.type),
        response_headers=bindparam("b_headers", type_=_t.c.response_headers.type),
        response_body=bindparam("b_body", type_=_t.c.response_body.type),
    )
)
