"""Refused deliveries (bad signature, stale timestamp; signed but unstorable), counted.

A refusal costs the sender nothing, so a flood of forgeries must not cost a
write each: 1,925 refused requests in 2 s once made 1,925 rows, each a turn
at SQLite's single write lock that real deliveries queued behind. Refusals
are therefore counted per source, reason, address and minute (one row with
a ``seen_count``), and each process adds up what it refused in memory and
writes it in one short transaction every ``REJECTION_FLUSH_SECONDS`` (and
when it exits). A flood from one address is one row a minute and one write
a second per process, whatever its rate; one from many addresses is bounded
by ``MAX_PENDING`` keys waiting, past which refusals are counted only in the
metrics (and a log line says how many were dropped).

Recording a refusal must never turn it into a 5xx: if the database is away,
the 401 still stands, and the counts wait for the next round.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flask import Flask, current_app
from sqlalchemy import case
from sqlalchemy.engine import Engine

from .background import BackgroundWriter
from .database import transaction
from .extensions import db
from .models import Rejection, utcnow

log = logging.getLogger(__name__)

EXTENSION = "webhook_receiver.rejections"
MAX_PENDING = 10_000
DETAIL_LENGTH = 500
ADDRESS_LENGTH = 100

_t = Rejection.__table__


@dataclass(frozen=True)
class _Key:
    source: str
    reason: str
    remote_addr: str
    minute: datetime


@dataclass
class _Tally:
    count: int
    detail: str
    last_seen_at: datetime


class RejectionCounter(BackgroundWriter[dict[_Key, _Tally]]):
    """One process's refusals not yet written, added up per key, and the thread that writes them."""

    thread_name = "rejections"
    unwritten = "refused deliveries"

    def __init__(self, engine: Engine, flush_seconds: float) -> None:
        super().__init__(engine, flush_seconds)
        self._pending: dict[_Key, _Tally] = {}
        self._dropped = 0

    def record(self, key: _Key, detail: str, at: datetime) -> None:
        """Count one refusal; it is written within the flush interval."""
        with self._lock:
            tally = self._pending.get(key)
            if tally is not None:
                tally.count += 1
                tally.last_seen_at = max(tally.last_seen_at, at)
            elif len(self._pending) < MAX_PENDING:
                self._pending[key] = _Tally(1, detail, at)
            else:
                self._dropped += 1
        if self.flush_seconds == 0:
            self.flush()
            return
        self.wake()

    def pending(self) -> int:
        """How many refusals wait to be written."""
        with self._lock:
            return sum(t.count for t in self._pending.values())

    def _take(self) -> dict[_Key, _Tally]:
        with self._lock:
            batch, self._pending = self._pending, {}
            dropped, self._dropped = self._dropped, 0
        if dropped:
            log.error(
                "dropped %d refused deliveries from the counts (more than %d keys waiting)",
                dropped,
                MAX_PENDING,
                extra={"outcome": "rejections_dropped"},
            )
        return batch

    def _size(self, batch: dict[_Key, _Tally]) -> int:
        return sum(t.count for t in batch.values())

    def _write(self, batch: dict[_Key, _Tally]) -> None:
        stmt = self._insert()
        # A later batch (or another process) adds to the minute's row.
        stmt = stmt.on_conflict_do_update(
            index_elements=["source", "reason", "remote_addr", "received_at"],
            set_={
                "seen_count": _t.c.seen_count + stmt.excluded.seen_count,
                "last_seen_at": case(
                    (_t.c.last_seen_at < stmt.excluded.last_seen_at, stmt.excluded.last_seen_at),
                    else_=_t.c.last_seen_at,
                ),
            },
        )
        rows = [
            {
                "source": key.source,
                "reason": key.reason,
                "remote_addr": key.remote_addr,
                "received_at": key.minute,
                "detail": tally.detail,
                "seen_count": tally.count,
                "last_seen_at": tally.last_seen_at,
            }
            # Rows in key order: two processes' batches never deadlock.
            for key, tally in sorted(
                batch.items(),
                key=lambda kv: (kv[0].minute, kv[0].source, kv[0].reason, kv[0].remote_addr),
            )
        ]
        with transaction(self.engine) as conn:
            for row in rows:  # one upsert each: executemany cannot take ON CONFLICT's excluded
                conn.execute(stmt, row)

    def _insert(self) -> Any:
        # The engine's own dialect: this runs on the counter's thread, outside the app.
        if self.engine.dialect.name == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            return pg_insert(_t)
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(_t)

    def _put_back(self, batch: dict[_Key, _Tally]) -> None:
        with self._lock:
            for key, tally in batch.items():
                mine = self._pending.get(key)
                if mine is not None:
                    mine.count += tally.count
                    mine.last_seen_at = max(mine.last_seen_at, tally.last_seen_at)
                elif len(self._pending) < MAX_PENDING:
                    self._pending[key] = tally
                else:
                    self._dropped += tally.count
        if self.flush_seconds:
            self._due.set()  # try again after the interval


def record(source: str, reason: str, detail: str, remote_addr: str | None) -> None:
    """Count one refused delivery of ``source``; log, never raise, if it cannot be stored."""
    now = utcnow()
    key = _Key(
        source=source,
        reason=reason,
        # "" rather than NULL: NULLs never meet in a unique constraint.
        remote_addr=(remote_addr or "")[:ADDRESS_LENGTH],
        minute=now.replace(second=0, microsecond=0),
    )
    try:
        counter(current_app).record(key, detail[:DETAIL_LENGTH], now)
    except Exception:
        log.warning("could not record a refused delivery", exc_info=True)


_CREATING = threading.Lock()


def counter(app: Flask) -> RejectionCounter:
    """The app's refusal counter, made on the first refusal."""
    found: RejectionCounter | None = app.extensions.get(EXTENSION)
    if found is None:
        with _CREATING:
            found = app.extensions.get(EXTENSION)
            if found is None:
                seconds = float(app.config.get("REJECTION_FLUSH_SECONDS", 1.0))
                found = app.extensions[EXTENSION] = RejectionCounter(db.engine, seconds)
    return found
