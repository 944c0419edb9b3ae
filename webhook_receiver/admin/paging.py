"""Keyset paging for the admin's lists, and the row ids their URLs carry.

Lists are paged with a keyset cursor on (timestamp, id), newest first, so a
page costs the same at row one million as at row one: no OFFSET, and no
COUNT(*) over a whole table.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Select, literal, tuple_

from ..extensions import db
from ..models import UTCDateTime

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# Row ids are signed 64-bit on PostgreSQL and SQLite alike: a larger number
# names no row, and the drivers refuse to bind it.
MAX_ID = 2**63 - 1


def is_row_id(raw: str) -> bool:
    """Tell whether a string is a row id: ASCII digits (not "²") within 64 bits."""
    return raw.isascii() and raw.isdigit() and len(raw) <= 19 and int(raw) <= MAX_ID


@dataclass(frozen=True)
class Cursor:
    """A position in a list ordered by (at, id): the row just outside the page."""

    at: datetime
    id: int

    def encode(self) -> str:
        """Render as ``<microseconds since epoch>.<id>``, exact on every database."""
        micros = (self.at - EPOCH) // timedelta(microseconds=1)
        return f"{micros}.{self.id}"

    @classmethod
    def decode(cls, raw: str) -> Cursor:
        """Parse what ``encode`` made; ValueError when it is not one."""
        micros, _, ident = raw.partition(".")
        digits = micros.removeprefix("-")
        if not (digits.isascii() and digits.isdigit() and len(digits) <= 18) or not is_row_id(
            ident
        ):
            raise ValueError(f"not a cursor: {raw!r}")
        try:
            at = EPOCH + timedelta(microseconds=int(micros))
        except OverflowError as exc:
            raise ValueError(f"cursor out of range: {raw!r}") from exc
        return cls(at, int(ident))


@dataclass(frozen=True)
class Page:
    """One page of rows, newest first, with the cursors of its neighbours."""

    rows: list[Any]
    newer: Cursor | None = None
    older: Cursor | None = None


def keyset_page(
    stmt: Select[*tuple[Any, ...]],
    at_col: Any,
    id_col: Any,
    *,
    limit: int,
    before: Cursor | None = None,
    after: Cursor | None = None,
    row_key: Any = None,
) -> Page:
    """Run ``stmt`` for one page ordered by (at_col, id_col) descending.

    ``before`` asks for the rows older than a cursor, ``after`` for the rows
    newer than it (read ascending, then turned round). One extra row is read
    to know whether there is a further page. A cursor names the row at the
    edge of the page it came from, left out of the next; an empty page's
    links take that row in again. ``row_key(row)`` gives a row's
    (at, id); by default the row's attributes named like the columns.
    """
    key = tuple_(at_col, id_col)

    def bound(cursor: Cursor) -> Any:
        return tuple_(literal(cursor.at, UTCDateTime()), literal(cursor.id, id_col.type))

    def position(row: Any) -> Cursor:
        if row_key is not None:
            at, ident = row_key(row)
        else:
            at, ident = getattr(row, at_col.key), getattr(row, id_col.key)
        return Cursor(at, ident)

    if after is not None:
        rows = list(
            db.session.execute(
                stmt.where(key > bound(after)).order_by(at_col.asc(), id_col.asc()).limit(limit + 1)
            ).all()
        )
        more = len(rows) > limit
        rows = rows[:limit][::-1]
        if not rows:
            # Nothing newer is left (rows were requeued, purged): the older
            # link starts at the cursor's own row, which no other page shows.
            return Page([], None, Cursor(after.at, min(after.id + 1, MAX_ID)))
        return Page(rows, position(rows[0]) if more else None, position(rows[-1]))

    if before is not None:
        stmt = stmt.where(key < bound(before))
    rows = list(
        db.session.execute(stmt.order_by(at_col.desc(), id_col.desc()).limit(limit + 1)).all()
    )
    more = len(rows) > limit
    rows = rows[:limit]
    if not rows:
        # As above: the newer link starts at the cursor's own row.
        return Page([], None if before is None else Cursor(before.at, max(before.id - 1, 0)), None)
    newer = position(rows[0]) if before is not None else None
    return Page(rows, newer, position(rows[-1]) if more else None)
