"""Where ``@idempotent`` keeps its records: a persistence layer, as Powertools' engine has one.

The decorator asks its persistence for everything that touches storage and
knows no table, session or driver. ``Persistence`` keeps the records in
this app's database (records.py: the state machine; statements.py: its
SQL). A view whose unit of work the records
can be written with more cheaply passes a subclass that composes the two
(the API's event and its record: api/event_records.py); the engine is the
same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

from ...database import unit_of_work
from ...database_driver import one_connection
from ...extensions import db
from . import records
from .records import Claimed, InFlight, Mismatch, Replay, Request

Answer = Replay | Mismatch | InFlight


class RunAgain(Exception):
    """The unit of work cannot be saved as it stands: roll back and run the view anew.

    Raised by a persistence's ``save`` (a reserved id handed out twice,
    say); nothing was written.
    """


class Unit:
    """The one-commit unit of work: the view's writes, then its answer saved under the key."""

    def discard(self) -> None:
        """Roll back the view's writes: a view that raised keeps only its answer."""
        db.session.rollback()

    def save(
        self,
        req: Request,
        response: tuple[int, list[list[str]], bytes],
        now: datetime,
        ttl: timedelta,
        lock_timeout: float,
    ) -> bool:
        """Claim the key with the answer, in the unit's transaction; False if it is taken."""
        return records.save_in_transaction(req, response, now, ttl, lock_timeout)


class ClaimedUnit:
    """The two-phase unit of work: the view's writes and the completion, fenced by the lease."""

    def __init__(self, claimed: Claimed) -> None:
        self.claimed = claimed

    def discard(self) -> None:
        """Roll back the view's writes, keeping the claim held (SQLite takes its lock again)."""
        db.session.rollback()
        records.hold(self.claimed)

    def complete(self, status: int, headers: list[list[str]], body: bytes, now: datetime) -> None:
        """Save the answer; raise ``records.LeaseLost`` if the lease was taken over."""
        records.complete(self.claimed, status, headers, body, now)


class Persistence:
    """The records in this app's database: the default persistence of ``@idempotent``."""

    @contextmanager
    def connection(self) -> Iterator[None]:
        """Serve the block's reads and one-statement writes from one pooled connection."""
        with one_connection(db.engine):
            yield

    def find(self, req: Request, now: datetime) -> Answer | None:
        """The key's answer read outside any transaction, or None if the key is free."""
        return records.find(req, now)

    @contextmanager
    def transaction(self) -> Iterator[Unit]:
        """One transaction for the view's writes and the saved answer, committed at the end."""
        with unit_of_work():
            yield Unit()

    def claim(
        self, req: Request, now: datetime, lease: timedelta, ttl: timedelta
    ) -> records.Outcome:
        """Claim the key under a lease, committed before the view runs, or say why not."""
        return records.claim(req, now, lease, ttl)

    @contextmanager
    def claimed_transaction(self, claimed: Claimed) -> Iterator[ClaimedUnit]:
        """The claimed view's transaction; raises ``records.LeaseLost`` if the lease is gone.

        On SQLite the view runs in the writers' turn and under the write
        lock, taken by a write to the claimed record before the view.
        """
        with unit_of_work():
            records.hold(claimed)
            yield ClaimedUnit(claimed)

    def release(self, claimed: Claimed) -> None:
        """Give the key back after a failure, committed, so that a retry runs again."""
        with unit_of_work():
            records.release(claimed)
