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
  JSON parameter (``batch_rows.BatchRows``), inside the batch's transaction.

The tables and their columns are in tables.py, a batch's row builders in
batch_rows.py.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    Integer,
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
from ..database_driver import DriverStatement, PerEngine, insert_unless_stored
from .batch_rows import BatchRows, SqliteBatch
from .tables import (
    DELIVERY_DEFAULTS,
    EVENT_COLUMNS,
    conflicts,
    deliveries,
    events,
)

__all__ = ["Statements", "for_engine", "receive_if", "reserved_id_is_current"]


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
    row = {name: _value(name) for name in EVENT_COLUMNS}
    inserted = insert_unless_stored(events, row, stored, ["source", "dedup_key"], "inserted")
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


# The statements of an engine, built on first use (each engine its own dialect).
for_engine = PerEngine(Statements).get
