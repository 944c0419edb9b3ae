"""A batch's rows as its fast paths send them: SQLite's repeated ``VALUES``, PostgreSQL's JSON.

Built once per engine by statements.for_engine; receive_many's writers
(batch_writes.py) run them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, Integer, LargeBinary, String, insert

from ..database_driver import DriverStatement, FastPathError
from ..models import UTCDateTime
from ..outbox.deliveries import new_delivery_columns
from .messages import Message
from .tables import (
    DELIVERY_COLUMNS,
    DELIVERY_DEFAULTS,
    EVENT_COLUMNS,
    deliveries,
    event_row,
    events,
)

if TYPE_CHECKING:
    from .rows import Routes


# SQLite binds at most 32,766 parameters in one statement.
MAX_PARAMETERS = 32_766


class SqliteBatch:
    """SQLite's batch: the one-row INSERT's ``VALUES`` repeated, and the taken keys read over JSON.

    Core's executemany converted each row's parameters through SQLAlchemy's
    execution machinery; here a DriverStatement's converters make each
    row's values, and one multi-row ``INSERT ... ON CONFLICT DO NOTHING``
    takes up to ``chunk`` rows. The keys already taken are then one lookup
    each, from one JSON parameter. The new events' deliveries are
    multi-row INSERTs the same way (``deliveries``): through Core, their
    three times per row made them the batch's largest cost in Python.

    Every read answers one row, its rows as one JSON array: the driver lets
    go of the GIL for every row it steps to, and each time a busy consumer
    thread took it, the batch waited to get it back (``RETURNING`` and a
    row per event found made the batch's reads ten times slower in a
    consumer than alone). The new events are read back by their ids: the
    batch holds the write lock, and SQLite gives each inserted row the
    table's largest rowid plus one, so a statement's new rows are the
    ``changes()`` ids ending at ``last_insert_rowid()``.
    """

    MAX_PARAMETERS = MAX_PARAMETERS

    def __init__(self, insert_events: Any, dialect: Any) -> None:
        self._events = _SqliteRows(insert_events, dialect, EVENT_COLUMNS)
        self.chunk = self._events.chunk
        self.deliveries = _SqliteRows(insert(deliveries), dialect, ("event_id", *DELIVERY_COLUMNS))
        self.new_sql = (
            "SELECT json_group_array(json_array(id, source, dedup_key)) FROM events "
            "WHERE id BETWEEN ? AND ?"
        )
        # CROSS JOIN: SQLite keeps the keys as the outer loop, an index lookup each.
        self.find_sql = (
            "SELECT json_group_array(json_array(e.id, e.source, e.dedup_key, e.fingerprint)) "
            "FROM json_each(?) AS k "
            "CROSS JOIN events AS e ON e.source = json_extract(k.value, '$[0]') "
            "AND e.dedup_key = json_extract(k.value, '$[1]')"
        )

    def insert_sql(self, count: int) -> str:
        """The events INSERT of ``count`` rows (at most ``chunk``)."""
        return self._events.insert_sql(count)

    def params(self, rows: list[dict[str, Any]]) -> list[Any]:
        """The values of the events ``rows``, row after row, converted by the columns' types."""
        return self._events.params(rows)


class _SqliteRows:
    """A one-row INSERT of some columns, its ``VALUES`` repeated for many rows (SQLite)."""

    def __init__(self, statement: Any, dialect: Any, columns: tuple[str, ...]) -> None:
        self._one = DriverStatement(statement, dialect, columns)
        sql = self._one.sql
        values = re.search(r"VALUES (\(\?(?:, \?)*\))", sql)
        if values is None or sql.count("?") != values.group(1).count("?"):
            raise FastPathError(f"not a one-row INSERT with only its values bound: {sql!r}")
        self._head, self._row, self._tail = (
            sql[: values.start(1)],
            values.group(1),
            sql[values.end(1) :],
        )
        self.chunk = MAX_PARAMETERS // self._row.count("?")

    def insert_sql(self, count: int) -> str:
        """The INSERT of ``count`` rows (at most ``chunk``).

        Built each time (microseconds against the rows' conversion): kept,
        one per batch size, they could add up to megabytes. The driver's own
        statement cache keeps the sizes in use prepared.
        """
        return self._head + ", ".join([self._row] * count) + self._tail

    def params(self, rows: list[dict[str, Any]]) -> list[Any]:
        """The values of ``rows``, row after row, converted by the columns' types."""
        return self._one.rows_params(rows)

    def insert(self, cursor: Any, rows: list[dict[str, Any]]) -> None:
        """Insert ``rows`` on ``cursor``, ``chunk`` rows a statement."""
        for start in range(0, len(rows), self.chunk):
            chunk = rows[start : start + self.chunk]
            cursor.execute(self.insert_sql(len(chunk)), self.params(chunk))


# The batch statement's last column: the events table's size, as the
# planner reads it (its pages on disk, not its last statistics).
EVENTS_BYTES = "pg_relation_size('events')"
# From this size of the events table a batch's statement is prepared: the
# server keeps its plan rather than parsing and planning it again for each
# batch (a third of its time on a batch of 200). Below it a plan could read
# the table by a scan, cheapest while it holds a few pages, and a kept plan
# would go on scanning it as it grows, each batch slower than the last;
# from a few dozen pages (8 KiB each) every plan reads it by its unique
# index, and PostgreSQL makes a kept plan again only when the table's
# statistics change (an analyze), at a size at least this one.
PREPARED_FROM_BYTES = 1 << 20


class BatchRows:
    """PostgreSQL's batch: one statement, its rows one JSON parameter (``jsonb_array_elements``).

    One short statement whatever the batch's size (a multi-row ``VALUES``
    list is a new, long statement for every batch size), and one round
    trip: it inserts the new events and their deliveries (the outbox),
    reads the keys the insert skipped, and returns both. The rows go as one
    JSON document, serialised by one C call: as arrays, psycopg converted
    every element in Python, which cost a consumer more CPU than the rest
    of the statement. The server parses it once, as jsonb, each row an
    array read by position (``json_to_recordset`` parsed every nested
    value again to make its jsonb, four times slower for a batch of 200;
    ``jsonb_to_recordset`` over objects sorted every row's keys and made
    the server's share of a new event 27 us against 19). Values are
    converted by the columns' own types first, as SQLAlchemy would convert
    them (the contract tests compare the rows with the plain Core path's).
    """

    def __init__(self, dialect: Any) -> None:
        self._events = _JsonRows(events, EVENT_COLUMNS, dialect)
        self._defaults = _JsonRows(deliveries, DELIVERY_DEFAULTS, dialect)
        columns = ", ".join(EVENT_COLUMNS)
        wanted = ", ".join(DELIVERY_COLUMNS)
        # ``stored`` sees the events committed before the statement; a key
        # taken by a copy committed since is in neither result (find_sql).
        # Only the keys the INSERT skipped are looked up: a batch of new
        # events reads nothing. ``new``: each new event's id by its row.
        # The CTEs and the results apart, so that a statement may add its own
        # CTEs and result (batch_statements.py: a batch's riders).
        self.ctes = (
            f"batch AS ({self._events.select('events', numbered=True)}), "
            f"inserted AS (INSERT INTO events ({columns}) SELECT {columns} FROM batch "
            "ON CONFLICT (source, dedup_key) DO NOTHING RETURNING id, source, dedup_key), "
            "new AS (SELECT b.n, i.id FROM inserted AS i JOIN batch AS b "
            "ON b.source = i.source AND b.dedup_key = i.dedup_key), "
            f"stored AS ({_TAKEN}, k.n, k.fingerprint AS sent "
            "FROM (SELECT source, dedup_key, n, fingerprint FROM batch AS b "
            "WHERE NOT EXISTS (SELECT FROM inserted AS i "
            "WHERE i.source = b.source AND i.dedup_key = b.dedup_key)) AS k, "
            f"{_LOOKUP}), "
            f"enqueued AS (INSERT INTO deliveries (event_id, {wanted}) "
            "SELECT new.id, w.consumer, w.kind, "
            f"{', '.join(f'd.{name}' for name in DELIVERY_DEFAULTS)} FROM new "
            "JOIN (SELECT (r.v->>0)::integer AS n, r.v->>1 AS consumer, r.v->>2 AS kind, "
            "(r.v->>3)::integer AS d, r.i FROM jsonb_array_elements(%(deliveries)s::jsonb) "
            "WITH ORDINALITY AS r(v, i)) AS w ON w.n = new.n "
            f"JOIN ({self._defaults.select('defaults', numbered=True)}) AS d ON d.n = w.d "
            # Ids in the messages' order, as the worker takes them: the joins
            # above keep no order of their own.
            "ORDER BY w.i)"
        )
        # One row of JSON texts, each key named by its row's position in the
        # batch (``n``), a stored event's fingerprint only where it is not the
        # one sent: a few kilobytes, read at once, where a row per key (its
        # source, key and fingerprint) came back in several reads, each a
        # wait for a busy consumer's GIL, and cost Python a tuple a row.
        self.results = (
            "(SELECT json_agg(json_build_array(n, id) ORDER BY n)::text FROM new), "
            "(SELECT json_agg(json_build_array(s.n, s.id, nullif(s.fingerprint, s.sent)) "
            "ORDER BY s.n)::text FROM stored AS s)"
        )
        self.sql = f"WITH {self.ctes} SELECT {self.results}, NULL::boolean, {EVENTS_BYTES}"
        # Whether the events table was, at this engine's last batch, large
        # enough for its statement to be prepared (PREPARED_FROM_BYTES).
        self.events_large = False
        # The keys taken by a racing copy, read back with their fingerprints.
        self.find_sql = (
            f"{_TAKEN} FROM unnest(%(source)b::text[], %(dedup_key)b::text[]) "
            f"AS k(source, dedup_key), {_LOOKUP}"
        )

    def params(self, messages: Iterable[Message], now: datetime, routes: Routes) -> dict[str, str]:
        """The statement's JSON documents: the events of ``messages``, and their deliveries.

        ``messages`` are each key's first; a message's deliveries are those
        its routes give were it new (only those of events this statement
        inserts are written), each naming its event by its row and its
        defaults (``new_delivery_columns``) by theirs: they are the same
        for a receipt time, which a batch mostly shares, so each is made,
        converted and sent once. Rows are lists in column order: no dict
        per row.
        """
        events_rows: list[list[Any]] = []
        wanted: list[tuple[int, str, str, int]] = []
        defaults: dict[datetime, int] = {}
        defaults_rows: list[list[Any]] = []
        for row, message in enumerate(messages):
            # As for one message: a new delivery is due from its event's receipt.
            received_at = message.received_at or now
            events_rows.append(event_row(message, received_at))
            consumers = routes(message.source, message.event_type, message.body)
            if not consumers:
                continue
            at = defaults.get(received_at)
            if at is None:
                at = defaults[received_at] = len(defaults_rows)
                columns = new_delivery_columns(received_at)
                defaults_rows.append([columns[name] for name in DELIVERY_DEFAULTS])
            wanted += [(row, name, kind, at) for name, kind in consumers]
        return {
            "events": self._events.document(events_rows),
            "deliveries": self._events.dumps(wanted),
            "defaults": self._defaults.document(defaults_rows),
        }


# The event under each key ``k``, by one index lookup per key: a join would
# scan the whole table whenever its statistics are stale, and the plan is
# prepared once. LIMIT (the key is unique) keeps the planner from making
# the lateral subquery a join.
_TAKEN = "SELECT e.id, e.source, e.dedup_key, e.fingerprint"
_LOOKUP = (
    "LATERAL (SELECT id, source, dedup_key, fingerprint FROM events "
    "WHERE source = k.source AND dedup_key = k.dedup_key LIMIT 1) AS e"
)


class _JsonRows:
    """Some columns of a table as one JSON parameter: its SELECT, and the document of some rows.

    Each row is a JSON array of its values in column order, not an object:
    no column name repeated per row, so a batch's document is a fifth
    smaller for the client to serialise and the server to parse, and the
    server reads each value by its position (``->>``), in constant time.
    """

    def __init__(self, table: Any, names: tuple[str, ...], dialect: Any) -> None:
        expressions = []
        self._converters: list[tuple[int, Callable[[Any], Any], bool]] = []
        for position, name in enumerate(names):
            column_type = table.c[name].type.dialect_impl(dialect)
            element = _array_element(table.c[name].type)
            if element is None:
                raise FastPathError(f"no JSON reading for {table.name}.{name} ({column_type})")
            process = column_type.bind_processor(dialect)
            text = f"r.v->>{position}"
            if element == "bytea":
                # JSON has no bytes: sent as hex, decoded on the server.
                expression = f"decode({text}, 'hex')"
                process = bytes.hex
            elif element == "jsonb":
                # The value itself, inside the document: a JSON null stays
                # JSON null, unless the column maps None to SQL NULL, as in
                # SQLAlchemy.
                expression = f"r.v->{position}"
                if column_type.none_as_null:
                    expression = f"nullif({expression}, 'null'::jsonb)"
                process = None
            elif element == "timestamp":
                # Converted by the column (naive UTC), then as ISO 8601 text.
                expression = f"({text})::timestamp"
                process = _then_isoformat(process)
            elif element == "text":
                expression = text
            else:
                expression = f"({text})::{element}"
            expressions.append(f"{expression} AS {name}")
            if process is not None:
                self._converters.append((position, process, element == "timestamp"))
        self._expressions = ", ".join(expressions)
        # The engine's JSON serialiser (database.json_text: orjson).
        self._dumps: Callable[[Any], str] = getattr(dialect, "_json_serializer", None) or json.dumps

    def select(self, param: str, *, numbered: bool = False) -> str:
        """The rows of the JSON parameter ``param``, one column each, converted by the database.

        ``numbered``: and ``n``, each row's position in the document (from 0).
        """
        rows = f"jsonb_array_elements(%({param})s::jsonb)"
        if not numbered:
            return f"SELECT {self._expressions} FROM {rows} AS r(v)"
        return f"SELECT {self._expressions}, r.n - 1 AS n FROM {rows} WITH ORDINALITY AS r(v, n)"

    def document(self, rows: list[list[Any]]) -> str:
        """``rows`` (each its values in column order) as the JSON arrays ``select`` reads."""
        return self._dumps(self.convert(rows))

    def dumps(self, value: Any) -> str:
        """``value`` as JSON text, by the engine's serialiser."""
        return self._dumps(value)

    def convert(self, rows: list[list[Any]]) -> list[list[Any]]:
        """Convert ``rows``' values in place by their columns' types; returns ``rows``."""
        if not self._converters:
            return rows
        # Column by column; a batch's times are mostly one (its receipt):
        # each is converted once.
        for position, process, once in self._converters:
            if not once:
                for values in rows:
                    if (value := values[position]) is not None:
                        values[position] = process(value)
                continue
            done: dict[Any, Any] = {}
            for values in rows:
                if (value := values[position]) is not None:
                    if (converted := done.get(value)) is None:
                        converted = done[value] = process(value)
                    values[position] = converted
        return rows


def _then_isoformat(process: Callable[[Any], Any] | None) -> Callable[[Any], str]:
    # Never given None: document() leaves None as JSON null.
    def convert(value: Any) -> str:
        return str((process(value) if process is not None else value).isoformat())

    return convert


def _array_element(column_type: Any) -> str | None:
    """The PostgreSQL array element type for a column of the events table."""
    # Order matters: UTCDateTime is a TypeDecorator, JSON may be a variant.
    for kind, element in (
        (UTCDateTime, "timestamp"),
        (JSON, "jsonb"),
        (LargeBinary, "bytea"),
        (Integer, "integer"),
        (String, "text"),
    ):
        if isinstance(column_type, kind):
            return element
    return None
