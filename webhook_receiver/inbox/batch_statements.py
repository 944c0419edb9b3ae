"""A batch's riders: what its transaction (on PostgreSQL its one statement) writes beside it.

A broker consumer's batch carries the positions it moves its source to
(``broker_positions``: per topic and partition, the next offset to read),
so that the stored events and the place to read on from commit together.
The plain statements here serve every path's transaction; on PostgreSQL
:class:`RiddenBatch` folds the riders into the batch's one statement
(``statements.BatchRows``) as more CTEs, keeping it one round trip.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.engine import Engine

from ..database import dialect_insert
from ..models import BrokerPosition, UTCDateTime
from .rows import Position
from .statements import BatchRows
from .statements import for_engine as statements_for_engine

positions = BrokerPosition.__table__

# (source, topic, partition) -> the next offset: a batch's positions, the
# last one given for a partition winning (one statement cannot upsert a row
# twice).
Positions = dict[tuple[str, str, int], int]


def latest(given: Iterable[Position]) -> Positions:
    """The positions to write: per partition, the last one given."""
    return {(p.source, p.topic, p.partition): p.next_offset for p in given}


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
        """The upsert's rows (Core) for ``moved``."""
        return [
            {
                "source": source,
                "topic": topic,
                "partition": partition,
                "next_offset": offset,
                "updated_at": now,
            }
            for (source, topic, partition), offset in moved.items()
        ]


class RiddenBatch:
    """PostgreSQL: the batch's one statement with its positions as one more CTE (``moved``).

    The positions are written only when the statement settles every
    message itself: each key new, or taken by an event with the same
    fingerprint. Otherwise (a possible conflict, compared and kept in a
    transaction after this one; a key taken by a copy committed while the
    statement ran) the batch is not whole when the statement commits, and
    the positions go with that later transaction instead: a consumer that
    resumes from them never skips a message whose conflict was not kept.
    A key repeated in the batch with another fingerprint is known before:
    such a batch's positions are not given to the statement at all.

    Its results are the batch statement's, and one more row, all NULL, when
    the positions were written.
    """

    def __init__(self, rows: BatchRows) -> None:
        whole = (
            "(SELECT count(*) FROM inserted) + (SELECT count(*) FROM stored AS s "
            "JOIN batch AS b ON b.source = s.source AND b.dedup_key = s.dedup_key "
            "WHERE b.fingerprint = s.fingerprint) = (SELECT count(*) FROM batch)"
        )
        moved = (
            "moved AS (INSERT INTO broker_positions "
            "(source, topic, partition, next_offset, updated_at) "
            "SELECT p.source, p.topic, p.partition, p.next_offset, %(p_at)s::timestamp "
            "FROM unnest(%(p_source)s::text[], %(p_topic)s::text[], "
            "%(p_partition)s::integer[], %(p_offset)s::bigint[]) "
            "AS p(source, topic, partition, next_offset) "
            f"WHERE {whole} "
            "ON CONFLICT (source, topic, partition) DO UPDATE SET "
            "next_offset = excluded.next_offset, updated_at = excluded.updated_at "
            "RETURNING 1)"
        )
        self.sql = (
            f"WITH {rows.ctes}, {moved} {rows.results} "
            "UNION ALL SELECT NULL, NULL, NULL, NULL, NULL WHERE EXISTS (SELECT FROM moved)"
        )

    def params(self, moved: Positions, now: datetime) -> dict[str, Any]:
        """The positions' parameters, beside the batch statement's own."""
        return {
            "p_source": [source for source, _, _ in moved],
            "p_topic": [topic for _, topic, _ in moved],
            "p_partition": [partition for _, _, partition in moved],
            "p_offset": list(moved.values()),
            "p_at": _UTC_BIND(now, None),
        }


_UTC_BIND = UTCDateTime().process_bind_param

_BY_ENGINE: weakref.WeakKeyDictionary[Engine, BatchStatements] = weakref.WeakKeyDictionary()
_BUILDING = threading.Lock()


def for_engine(engine: Engine) -> BatchStatements:
    """The riders' statements of ``engine``, built on first use."""
    built = _BY_ENGINE.get(engine)
    if built is None:
        with _BUILDING:
            built = _BY_ENGINE.get(engine)
            if built is None:
                built = _BY_ENGINE[engine] = BatchStatements(engine)
    return built
