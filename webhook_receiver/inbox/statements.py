"""The inbox's SQL, built once per engine: the plain Core statements and the fast paths.

Every statement that writes a received message is here. The plain Core
statements serve SQLite's batches, in-transaction writes and the reference
path of the contract tests; the fast paths:

- SQLite, one message: the key read and the event INSERT run on the driver
  (:class:`~webhook_receiver.database_driver.DriverStatement`), the INSERT autocommitted when the
  event has no deliveries to write with it.
- PostgreSQL, one message: the read, the insert and the deliveries are one
  statement (CTEs), run on the driver in its own transaction: one round trip.
- PostgreSQL, a batch: the same in one statement over the rows as one
  JSON parameter (:class:`BatchRows`), inside the batch's transaction.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    JSON,
    Integer,
    LargeBinary,
    String,
    bindparam,
    func,
    insert,
    select,
    tuple_,
)
from sqlalchemy import true as literal_true
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine

from ..database import dialect_insert
from ..database_driver import DriverStatement, FastPathError
from ..models import Delivery, Event, EventConflict, UTCDateTime, utcnow
from ..outbox.deliveries import new_delivery_columns

events = Event.__table__
deliveries = Delivery.__table__
conflicts = EventConflict.__table__

# The columns an intake's message fills; id is the database's.
EVENT_COLUMNS = (
    "source",
    "dedup_key",
    "event_type",
    "fingerprint",
    "content_type",
    "body",
    "headers",
    "meta",
    "correlation_id",
    "client",
    "received_at",
)
# A new delivery's columns: its event, consumer and kind, then the defaults.
DELIVERY_DEFAULTS = tuple(new_delivery_columns(utcnow()))
DELIVERY_COLUMNS = ("consumer", "kind", *DELIVERY_DEFAULTS)
CONFLICT_COLUMNS = (
    "source",
    "dedup_key",
    "fingerprint",
    "content_type",
    "body",
    "headers",
    "received_at",
)


class Statements:
    """The statements of one engine (one dialect), compiled where it pays."""

    def __init__(self, engine: Engine) -> None:
        dialect = engine.dialect
        self.dialect_name = dialect.name
        self.find = select(events.c.id, events.c.fingerprint).where(
            events.c.source == bindparam("b_source"), events.c.dedup_key == bindparam("b_key")
        )
        self.find_many = select(
            events.c.id, events.c.source, events.c.dedup_key, events.c.fingerprint
        ).where(
            tuple_(events.c.source, events.c.dedup_key).in_(bindparam("b_keys", expanding=True))
        )
        ignoring = dialect_insert(events, engine).on_conflict_do_nothing(
            index_elements=["source", "dedup_key"]
        )
        # None on a taken key, else the new id.
        self.insert_event = ignoring.returning(events.c.id)
        # For a batch: which of its keys were new.
        self.insert_events = ignoring.returning(events.c.id, events.c.source, events.c.dedup_key)
        self.insert_deliveries = insert(deliveries)
        # What a content fingerprint is computed from (see receive_many).
        self.find_contents = select(
            events.c.id, events.c.body, events.c.event_type, events.c.content_type
        ).where(events.c.id.in_(bindparam("b_ids", expanding=True)))
        self.keep_conflict = _conflict_upsert(engine)
        # The event alone, on the driver: SQLite's receipt, and an event
        # with no deliveries added to a unit of work (inbox.add).
        self.fast_insert = DriverStatement(self.insert_event, dialect, EVENT_COLUMNS)
        if dialect.name == "sqlite":
            self.fast_find = DriverStatement(self.find, dialect)
            self.sqlite_batch = SqliteBatch(ignoring, dialect)
        elif dialect.name == "postgresql":
            self.fast_receive = DriverStatement(_receive_statement(), dialect)
            self.batch_insert = BatchRows(dialect)
            # Ids reserved for held events (inbox.holding), a block at a time,
            # and the last id the sequence handed out (reserved ids are below it).
            self.reserve_event_ids = DriverStatement(
                select(func.nextval(_events_sequence())).select_from(
                    func.generate_series(1, bindparam("b_count", type_=Integer()))
                ),
                dialect,
            )
            self.events_id_last_value = DriverStatement(select(_sequence_last_value()), dialect)


class SqliteBatch:
    """SQLite's batch: the one-row INSERT's ``VALUES`` repeated, and the taken keys read over JSON.

    Core's executemany converted each row's parameters through SQLAlchemy's
    execution machinery; here a DriverStatement's converters make each
    row's values, and one multi-row ``INSERT ... ON CONFLICT DO NOTHING``
    takes up to ``chunk`` rows. The keys already taken are then one lookup
    each, from one JSON parameter.

    Every read answers one row, its rows as one JSON array: the driver lets
    go of the GIL for every row it steps to, and each time a busy consumer
    thread took it, the batch waited to get it back (``RETURNING`` and a
    row per event found made the batch's reads ten times slower in a
    consumer than alone). The new events are read back by their ids: the
    batch holds the write lock, and SQLite gives each inserted row the
    table's largest rowid plus one, so a statement's new rows are the
    ``changes()`` ids ending at ``last_insert_rowid()``.
    """

    # SQLite binds at most 32,766 parameters in one statement.
    MAX_PARAMETERS = 32_766

    def __init__(self, insert_events: Any, dialect: Any) -> None:
        self._one = DriverStatement(insert_events, dialect, EVENT_COLUMNS)
        sql = self._one.sql
        values = re.search(r"VALUES (\(\?(?:, \?)*\))", sql)
        if values is None or sql.count("?") != values.group(1).count("?"):
            raise FastPathError(f"not a one-row INSERT with only its values bound: {sql!r}")
        self._head, self._row, self._tail = (
            sql[: values.start(1)],
            values.group(1),
            sql[values.end(1) :],
        )
        self.chunk = self.MAX_PARAMETERS // self._row.count("?")
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
        """The INSERT of ``count`` rows (at most ``chunk``).

        Built each time (microseconds against the rows' conversion): kept,
        one per batch size, they could add up to megabytes. The driver's own
        statement cache keeps the sizes in use prepared.
        """
        return self._head + ", ".join([self._row] * count) + self._tail

    def params(self, rows: list[dict[str, Any]]) -> list[Any]:
        """The values of ``rows``, row after row, converted by the columns' types."""
        return self._one.rows_params(rows)


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
        self._deliveries = _JsonRows(
            deliveries, DELIVERY_COLUMNS, dialect, keys=("source", "dedup_key")
        )
        columns = ", ".join(EVENT_COLUMNS)
        wanted = ", ".join(DELIVERY_COLUMNS)
        # ``stored`` sees the events committed before the statement; a key
        # taken by a copy committed since is in neither result (find_sql).
        # Only the keys the INSERT skipped are looked up: a batch of new
        # events reads nothing.
        # The CTEs and the results apart, so that a statement may add its own
        # CTEs (batch_statements.py: a batch's riders).
        self.ctes = (
            f"batch AS ({self._events.select('events')}), "
            f"inserted AS (INSERT INTO events ({columns}) SELECT * FROM batch "
            "ON CONFLICT (source, dedup_key) DO NOTHING RETURNING id, source, dedup_key), "
            f"stored AS ({_TAKEN} FROM (SELECT source, dedup_key FROM batch AS b "
            "WHERE NOT EXISTS (SELECT FROM inserted AS i "
            "WHERE i.source = b.source AND i.dedup_key = b.dedup_key)) AS k, "
            f"{_LOOKUP}), "
            f"enqueued AS (INSERT INTO deliveries (event_id, {wanted}) "
            f"SELECT i.id, {', '.join(f'w.{name}' for name in DELIVERY_COLUMNS)} "
            f"FROM inserted AS i JOIN ({self._deliveries.select('deliveries')}) AS w "
            "ON w.source = i.source AND w.dedup_key = i.dedup_key)"
        )
        self.results = (
            "SELECT id, source, dedup_key, NULL, true FROM inserted "
            "UNION ALL SELECT id, source, dedup_key, fingerprint, false FROM stored"
        )
        self.sql = f"WITH {self.ctes} {self.results}"
        # The keys taken by a racing copy, read back with their fingerprints.
        self.find_sql = (
            f"{_TAKEN} FROM unnest(%(source)b::text[], %(dedup_key)b::text[]) "
            f"AS k(source, dedup_key), {_LOOKUP}"
        )

    def params(self, rows: list[dict[str, Any]], wanted: list[dict[str, Any]]) -> dict[str, str]:
        """The statement's two JSON documents: the events ``rows``, and the deliveries ``wanted``.

        Each wanted delivery names its event by source and dedup key; only
        those of events this statement inserts are written.
        """
        return {
            "events": self._events.document(rows),
            "deliveries": self._deliveries.document(wanted),
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

    def __init__(
        self, table: Any, names: tuple[str, ...], dialect: Any, keys: tuple[str, ...] = ()
    ) -> None:
        # ``keys``: text columns that are not the table's (a delivery names its event by them).
        self._names = (*keys, *names)
        expressions = [f"r.v->>{position} AS {key}" for position, key in enumerate(keys)]
        self._converters: list[tuple[int, Callable[[Any], Any], bool]] = []
        for position, name in enumerate(names, start=len(keys)):
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

    def select(self, param: str) -> str:
        """The rows of the JSON parameter ``param``, one column each, converted by the database."""
        return f"SELECT {self._expressions} FROM jsonb_array_elements(%({param})s::jsonb) AS r(v)"

    def document(self, rows: list[dict[str, Any]]) -> str:
        """``rows`` as the JSON array of arrays ``select`` reads (other keys are ignored)."""
        names = self._names
        out = [[row[name] for name in names] for row in rows]
        if not self._converters:
            return self._dumps(out)
        # A batch's times are mostly one (its receipt): each is converted once.
        converters: list[tuple[int, Callable[[Any], Any], dict[Any, Any] | None]] = [
            (position, process, {} if once else None)
            for position, process, once in self._converters
        ]
        for values in out:
            for position, process, cache in converters:
                value = values[position]
                if value is None:
                    continue
                if cache is None:
                    values[position] = process(value)
                elif value in cache:
                    values[position] = cache[value]
                else:
                    values[position] = cache[value] = process(value)
        return self._dumps(out)


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


def _conflict_upsert(engine: Engine) -> Any:
    # One record per distinct content: a repeat of the same conflicting
    # delivery only counts.
    stmt = dialect_insert(conflicts, engine)
    return stmt.on_conflict_do_update(
        index_elements=["event_id", "fingerprint"],
        set_={
            "seen_count": conflicts.c.seen_count + 1,
            "last_seen_at": stmt.excluded.last_seen_at,
        },
    )


def _receive_statement() -> Any:
    """PostgreSQL's one-statement receipt.

    ``stored`` reads the event under the key; ``inserted`` inserts this one
    only when there is none (``ON CONFLICT DO NOTHING`` for a racing copy
    committed after the snapshot); ``enqueued`` writes a new event's
    deliveries (the outbox), one per element of the ``v_consumers`` and
    ``v_kinds`` arrays. All of it commits together.
    """
    stored = (
        select(events.c.id, events.c.fingerprint)
        .where(
            events.c.source == bindparam("v_source"),
            events.c.dedup_key == bindparam("v_dedup_key"),
        )
        .cte("stored")
    )
    new_row = select(*[_value(name) for name in EVENT_COLUMNS]).where(~select(stored.c.id).exists())
    inserted = (
        postgresql.insert(events)
        .from_select(list(EVENT_COLUMNS), new_row)
        .on_conflict_do_nothing(index_elements=["source", "dedup_key"])
        .returning(events.c.id)
        .cte("inserted")
    )
    enqueued = _enqueue(inserted)
    return select(
        select(stored.c.id).scalar_subquery().label("stored_id"),
        select(stored.c.fingerprint).scalar_subquery().label("stored_fingerprint"),
        select(inserted.c.id).scalar_subquery().label("event_id"),
        select(func.count()).select_from(enqueued).scalar_subquery().label("enqueued"),
    )


def receive_if(guard: Any, *, deliveries: bool = True) -> Any:
    """PostgreSQL: one new event (its id given) and its deliveries, if ``guard`` has a row.

    ``guard`` is a CTE of the caller's own write (the Idempotency-Key
    record's claim); the statement selects its id, None when it wrote
    nothing, and then writes nothing else either, and whether the event's
    reserved id is still one the sequence handed out (``id_current``), so
    that a guard that wrote nothing says why without another round trip.
    The event's key must be new: a taken one fails the whole statement (no
    ``ON CONFLICT``), so an answer never names an event that was not
    written. ``deliveries=False`` leaves the outbox out, for an event no
    consumer takes: fewer parameters to convert and a smaller plan.
    """
    names = ["id", *EVENT_COLUMNS]
    new_row = select(*[_value(name) for name in names]).where(select(guard.c.id).exists())
    inserted = (
        postgresql.insert(events).from_select(names, new_row).returning(events.c.id).cte("inserted")
    )
    written = _enqueue(inserted) if deliveries else inserted
    return select(
        select(guard.c.id).scalar_subquery().label("guard_id"),
        select(func.count()).select_from(written).scalar_subquery().label("written"),
        reserved_id_is_current().label("id_current"),
    )


def reserved_id_is_current() -> Any:
    """PostgreSQL: true if the reserved id ``v_id`` is one the events sequence has handed out.

    False once the sequence went back (a restore, a ``RESTART IDENTITY``):
    the id would be handed out again, and the writer it goes to would meet
    this event's row. A guard of ``receive_if`` writes nothing then.
    """
    return _value("id") <= _sequence_last_value()


def _sequence_last_value() -> Any:
    return func.pg_sequence_last_value(_events_sequence().cast(postgresql.REGCLASS))


def _events_sequence() -> Any:
    # The sequence behind events.id, by the column rather than by its name.
    return func.pg_get_serial_sequence("events", "id")


def _value(name: str) -> Any:
    # An events column's value in a one-statement receipt; the same bind wherever used.
    return bindparam(f"v_{name}", type_=events.c[name].type)


def _enqueue(inserted: Any) -> Any:
    """The deliveries (the outbox) of the event ``inserted`` returns, as a CTE.

    One per element of the ``v_consumers`` and ``v_kinds`` arrays, with the
    ``d_`` defaults of a new delivery.
    """
    wanted = (
        func.unnest(
            bindparam("v_consumers", type_=postgresql.ARRAY(String())),
            bindparam("v_kinds", type_=postgresql.ARRAY(String())),
        )
        .table_valued("consumer", "kind")
        .render_derived(name="wanted")
    )
    return (
        insert(deliveries)
        .from_select(
            ["event_id", "consumer", "kind", *DELIVERY_DEFAULTS],
            select(
                inserted.c.id,
                wanted.c.consumer,
                wanted.c.kind,
                *[
                    bindparam(f"d_{name}", type_=deliveries.c[name].type)
                    for name in DELIVERY_DEFAULTS
                ],
            ).select_from(inserted.join(wanted, literal_true())),
        )
        .returning(deliveries.c.id)
        .cte("enqueued")
    )


_BY_ENGINE: weakref.WeakKeyDictionary[Engine, Statements] = weakref.WeakKeyDictionary()
_BUILDING = threading.Lock()


def for_engine(engine: Engine) -> Statements:
    """The statements of ``engine``, built on first use (each engine its own dialect)."""
    built = _BY_ENGINE.get(engine)
    if built is None:
        with _BUILDING:
            built = _BY_ENGINE.get(engine)
            if built is None:
                built = _BY_ENGINE[engine] = Statements(engine)
    return built
