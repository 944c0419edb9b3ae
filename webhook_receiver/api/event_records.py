"""The API's unit of work: its event and the Idempotency-Key record, written together.

The one place that knows both the inbox and the idempotency engine's
records. ``EventRecords`` is the persistence ``POST /api/events`` passes to
``@idempotent``: on PostgreSQL the view's new event is held back
(``inbox.holding``), and when it is all the view wrote, the event, its
deliveries, the key's claim and the saved answer are one autocommitted
statement (``inbox.GuardedReceipt`` with the record's upsert as its guard).
Otherwise the held event is written in the unit's transaction, then the
record, as the engine's default does. On SQLite nothing is held.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from .. import inbox
from ..database import unit_of_work, untouched
from ..extensions import db
from ..idempotency.persistence import Persistence, RunAgain, Unit, records
from ..idempotency.persistence.statements import upsert_statement


def _claim_and_answer(only_if: Any) -> Any:
    # The key's claim and its saved answer (the record's upsert), written
    # only if ``only_if`` holds.
    return upsert_statement("postgresql", only_if=only_if)


_RECEIPT = inbox.GuardedReceipt(_claim_and_answer)


class EventUnit(Unit):
    """The view's transaction with its held event (PostgreSQL)."""

    def __init__(self, held: list[inbox.HeldEvent]) -> None:
        self.held = held

    def discard(self) -> None:
        super().discard()
        self.held.clear()

    def save(
        self,
        req: records.Request,
        response: tuple[int, list[list[str]], bytes],
        now: datetime,
        ttl: timedelta,
        lock_timeout: float,
    ) -> bool:
        if len(self.held) == 1 and untouched(db.session):
            # The event was the view's only write: one statement, its own transaction.
            params = records.completed_params(req, response, now, ttl, lock_timeout, "postgresql")
            with records.key_locked_raised():
                return _RECEIPT.write(self.held[0], params) is not None
        inbox.write_held(self.held)
        return super().save(req, response, now, ttl, lock_timeout)


class EventRecords(Persistence):
    """The records of ``@idempotent``, with the view's event written in the same statement."""

    @contextmanager
    def transaction(self) -> Iterator[Unit]:
        try:
            with inbox.holding() as held, unit_of_work():
                yield EventUnit(held)
        except inbox.ReservedIdTaken as exc:
            # The event's reserved id was handed out again (the sequence
            # went back): nothing was written; run with a fresh one.
            raise RunAgain() from exc
