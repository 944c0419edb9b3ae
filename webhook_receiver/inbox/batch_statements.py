"""A batch's riders: what its transaction (on PostgreSQL its one statement) writes beside it.

A broker consumer's batch carries the positions it moves its source to
(``broker_positions``: per topic and partition, the next offset to read),
so that the stored events and the place to read on from commit together,
and its redeliveries' counts (``event_duplicates`` rows), so that a
consumer acknowledges no message whose count is not written. The plain
statements here serve every path's transaction (the counts' are in
duplicates.py); on PostgreSQL :class:`RiddenBatch` folds the riders into
the batch's one statement (``batch_rows.BatchRows``) as more CTEs,
keeping it one round trip.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.engine import Engine

from ..database import dialect_insert
from ..database_driver import PerEngine
from ..models import BrokerPosition, UTCDateTime
from .batch_rows import EVENTS_BYTES, BatchRows
from .messages import Message
from .rows import Position
from .statements import for_engine as statements_for_engine

positions = BrokerPosition.__table__

# (source, topic, partition) -> the next offset: a batch's positions, the
# last one given for a partition winning (one statement cannot upsert a row
# twice).
Positions = dict[tuple[str, str, int], int]


def latest(given: Iterable[Position]) -> Positions:
    """The positions to write: per partition, the last one given."""
    return {(p.source, p.topic, p.partition): p.next_offset for p in given}


def in_key_order(moved: Positions) -> list[tuple[tuple[str, str, int], int]]:
    """``moved``'s positions sorted by their keys: the order every batch upserts them in.

    Each upsert locks its row until the commit; consumers of one source
    whose batches move the same partitions (a rebalance) then wait for each
    other rather than each hold a row the other waits for (a deadlock). A
    batch moves a few partitions: the sort costs next to nothing.
    """
    return sorted(moved.items())


class BatchStatements:
    """The riders' statements of one engine."""

    def __init__(self, engine: Engine) -> None:
        upsert = dialect_insert(positions, engine)
        # Overwritten, not only moved forward: a consumer may seek back on purpose.
        self.upsert_positions = upsert.on_conflict_do_update(
            index_elements=["source", "topic", "partition"],
            set_={
                "next_offset": upsert.excluded.next_offset,
                "updated_at": upsert.excluded.updated_at,
            },
        )
        self.find_positions = select(
            positions.c.topic, positions.c.partition, positions.c.next_offset
        ).where(positions.c.source == bindparam("p_source"))
        if engine.dialect.name == "postgresql":
            self.ridden_batch = RiddenBatch(statements_for_engine(engine).batch_insert)

    def position_rows(self, moved: Positions, now: datetime) -> list[dict[str, Any]]:
        """The upsert's rows (Core) for ``moved``, in the order of their keys (see in_key_order)."""
        return [
            {
                "source": source,
                "topic": topic,
                "partition": partition,
                "next_offset": offset,
                "updated_at": now,
            }
            for (source, topic, partition), offset in in_key_order(moved)
        ]


class RiddenBatch:
    """PostgreSQL: the batch's one statement with its riders as more CTEs.

    ``settled`` finds the redeliveries the statement settles itself: each
    key taken by an event with its first message's fingerprint, and each
    later copy of a key (``c_`` arrays) with the fingerprint it is compared
    with (the stored event's, or the new event's first message's): what
    ``batch._settle_batch`` calls a duplicate. ``whole`` says whether that
    is every message but the new ones (``total``). Only then are the riders
    written: ``counted`` writes the redeliveries' ``event_duplicates`` rows
    when asked (``c_write``), in event id order as the ledger does, and
    ``moved`` upserts the positions. Otherwise (a possible conflict,
    compared and kept in a transaction after this one; a key taken by a
    copy committed while the statement ran) the batch is not whole when
    the statement commits, and its riders go with that later transaction:
    a consumer that resumes from its positions never skips a message whose
    conflict was not kept, and should that transaction fail, the batch sent
    again is counted once.

    A statement that inserts no event (a batch of redeliveries) commits
    without waiting for the log's flush (``synchronous_commit`` off for its
    own transaction, through ``set_config``): what it wrote, counts and
    positions, survives the consumer being killed, and is lost only if the
    server fails within a fraction of a second; a lost position sends the
    consumer back over messages it finds stored.

    Its result is the batch statement's, whose last column says whether the
    batch was whole (its riders written).
    """

    def __init__(self, rows: BatchRows) -> None:
        copies = (
            "unnest(%(c_source)s::text[], %(c_key)s::text[], %(c_fingerprint)s::text[], "
            "%(c_at)s::timestamp[]) AS c(source, dedup_key, fingerprint, at)"
        )
        settled = (
            "settled AS (SELECT s.id, b.received_at AS at FROM stored AS s "
            "JOIN batch AS b ON b.source = s.source AND b.dedup_key = s.dedup_key "
            "WHERE b.fingerprint = s.fingerprint "
            f"UNION ALL SELECT coalesce(s.id, i.id), c.at FROM {copies} "
            "JOIN batch AS b ON b.source = c.source AND b.dedup_key = c.dedup_key "
            "LEFT JOIN stored AS s ON s.source = c.source AND s.dedup_key = c.dedup_key "
            "LEFT JOIN inserted AS i ON i.source = c.source AND i.dedup_key = c.dedup_key "
            "WHERE c.fingerprint = CASE WHEN s.id IS NOT NULL THEN s.fingerprint "
            "WHEN i.id IS NOT NULL THEN b.fingerprint END)"
        )
        # A batch that inserts no event writes bookkeeping only (counts,
        # positions): its commit need not wait for the log's flush, which on
        # the consumer's storing thread cost more than the statement.
        whole = (
            "whole AS (SELECT (SELECT count(*) FROM inserted) "
            "+ (SELECT count(*) FROM settled) = %(total)s::bigint AS yes, "
            "CASE WHEN NOT EXISTS (SELECT FROM inserted) "
            "THEN set_config('synchronous_commit', 'off', true) END AS relaxed)"
        )
        counted = (
            "counted AS (INSERT INTO event_duplicates (event_id, received_at) "
            "SELECT id, at FROM settled WHERE %(c_write)s AND (SELECT yes FROM whole) "
            "ORDER BY id)"
        )
        moved = (
            "moved AS (INSERT INTO broker_positions "
            "(source, topic, partition, next_offset, updated_at) "
            "SELECT p.source, p.topic, p.partition, p.next_offset, %(p_at)s::timestamp "
            "FROM unnest(%(p_source)s::text[], %(p_topic)s::text[], "
            "%(p_partition)s::integer[], %(p_offset)s::bigint[]) "
            "AS p(source, topic, partition, next_offset) "
            "WHERE (SELECT yes FROM whole) "
            "ON CONFLICT (source, topic, partition) DO UPDATE SET "
            "next_offset = excluded.next_offset, updated_at = excluded.updated_at)"
        )
        self.sql = (
            f"WITH {rows.ctes}, {settled}, {whole}, {counted}, {moved} "
            f"SELECT {rows.results}, (SELECT yes FROM whole), {EVENTS_BYTES}"
        )

    def params(
        self,
        messages: Sequence[Message],
        first: dict[tuple[str, str], int],
        moved: Positions,
        count: bool,
        now: datetime,
    ) -> dict[str, Any]:
        """The riders' parameters, beside the batch statement's own.

        ``first``: each key's first message, by index; the others are its
        copies. ``count``: write the redeliveries' rows.
        """
        times: dict[datetime, datetime | None] = {}
        moves = in_key_order(moved)
        copies: list[Message] = []
        if len(first) < len(messages):  # a key comes again
            copies = [m for i, m in enumerate(messages) if first[(m.source, m.dedup_key)] != i]
        for m in copies:
            at = m.received_at or now
            if at not in times:
                times[at] = _UTC_BIND(at, None)
        return {
            "c_source": [m.source for m in copies],
            "c_key": [m.dedup_key for m in copies],
            "c_fingerprint": [m.fingerprint for m in copies],
            "c_at": [times[m.received_at or now] for m in copies],
            "c_write": count,
            "total": len(messages),
            "p_source": [source for (source, _, _), _ in moves],
            "p_topic": [topic for (_, topic, _), _ in moves],
            "p_partition": [partition for (_, _, partition), _ in moves],
            "p_offset": [offset for _, offset in moves],
            "p_at": _UTC_BIND(now, None),
        }


_UTC_BIND = UTCDateTime().process_bind_param

# The riders' statements of an engine, built on first use.
for_engine = PerEngine(BatchStatements).get
