"""Retention: ``flask purge`` deletes what is past its lifetime, in bounded batches.

- Events past their source's ``retention_days``; API events (``api:<client>``)
  past ``API_RETENTION_DAYS``; events of a source or client no longer in the
  config past ``DEFAULT_RETENTION_DAYS``. Their duplicates, conflicts and
  (final) deliveries go with them, and the deliveries' attempts (the
  attempt log) with those: the foreign keys cascade.
- Never an event with a delivery that is not final (pending, in progress or
  dead): it is kept, and counted, until its deliveries are delivered,
  skipped or discarded. A dead letter is never lost silently: it goes only
  once an operator has discarded it in the admin.
- Never an event with a conflict not reviewed yet: the conflict is kept for
  an operator to see, and goes with its event once marked reviewed.
- Idempotency records past ``expires_at``.
- Rejections past their source's retention, admin login failures past
  ``DEFAULT_RETENTION_DAYS``.

Each batch is one short transaction, so the purge never holds locks for
long and can run beside live traffic. Batches walk forward by
``(time, id)``, so rows that must be kept are read once per run, not once
per batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import click
from flask import Flask, current_app
from flask.cli import with_appcontext
from sqlalchemy import CursorResult, Table, and_, delete, exists, false, not_, or_, select
from sqlalchemy.sql.elements import ColumnElement

from .config import FileConfig
from .database import end_read, is_sqlite, unit_of_work
from .extensions import db
from .idempotency.persistence import records
from .models import AdminLoginFailure, Delivery, Event, EventConflict, Rejection
from .outbox import deliveries

_events = Event.__table__
_deliveries = Delivery.__table__
_conflicts = EventConflict.__table__
_rejections = Rejection.__table__
_login_failures = AdminLoginFailure.__table__

# Only these delivery states (delivered, skipped, discarded) let an event
# go; pending, in_progress and dead still need the event (a dead letter may
# be requeued, until an operator discards it).
FINAL_STATES = deliveries.FINAL_STATES


@dataclass
class PurgeReport:
    """What one purge removed, and what it had to keep."""

    events: int = 0
    events_kept: int = 0
    idempotency_records: int = 0
    rejections: int = 0
    login_failures: int = 0
    per_source: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Scope:
    """Rows of some sources, and how old they must be to go."""

    label: str
    where: ColumnElement[bool]
    cutoff: datetime


def _still_needed(event_id: Any) -> ColumnElement[bool]:
    """A delivery not final, or a conflict not reviewed: the event must stay."""
    return or_(
        exists().where(
            _deliveries.c.event_id == event_id, _deliveries.c.state.not_in(FINAL_STATES)
        ),
        exists().where(_conflicts.c.event_id == event_id, _conflicts.c.reviewed_at.is_(None)),
    )


def _lock_events(event_ids: list[int]) -> list[Any]:
    """Lock these events' deliveries, then the events, in id order, waiting for any writer."""
    # The events' locks wait for a conflict being kept under one of them
    # (its insert holds the event's key-share lock until it commits).
    return [
        select(table.c.id).where(column.in_(event_ids)).order_by(table.c.id).with_for_update()
        for table, column in ((_deliveries, _deliveries.c.event_id), (_events, _events.c.id))
    ]


def _scopes(
    column: Any, now: datetime, config: dict[str, Any], *, with_clients: bool
) -> list[_Scope]:
    """One scope per configured source (and client), then one for everything else."""
    file_config: FileConfig = config["FILE_CONFIG"]
    scopes = [
        _Scope(name, column == name, now - timedelta(days=days))
        for name, days in file_config.retention_days().items()
    ]
    if with_clients:
        api_cutoff = now - timedelta(days=_days(config, "API_RETENTION_DAYS"))
        scopes += [
            _Scope(f"api:{name}", column == f"api:{name}", api_cutoff)
            for name in file_config.clients
        ]
    known = [s.label for s in scopes]
    rest = not_(column.in_(known)) if known else column.is_not(None)
    scopes.append(
        _Scope(
            "(unconfigured)", rest, now - timedelta(days=_days(config, "DEFAULT_RETENTION_DAYS"))
        )
    )
    return scopes


def _days(config: dict[str, Any], name: str) -> int:
    value = config[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise click.UsageError(f"{name} must be a positive number of days, not {value!r}")
    return value


def _purge_scope(
    table: Table,
    time_column: Any,
    scope: _Scope,
    batch_size: int,
    *,
    blocked: ColumnElement[bool] | None = None,
    lock_first: Callable[[list[int]], list[Any]] | None = None,
) -> tuple[int, int]:
    """Delete the scope's rows older than its cutoff; return (deleted, kept)."""
    deleted = kept = 0
    after: tuple[datetime, int] | None = None
    old = (scope.where, time_column < scope.cutoff)
    while True:
        flag = blocked if blocked is not None else false()
        query = select(table.c.id, time_column, flag).where(*old)
        if after is not None:
            at, last_id = after
            query = query.where(
                or_(time_column > at, and_(time_column == at, table.c.id > last_id))
            )
        query = query.order_by(time_column, table.c.id).limit(batch_size)
        rows = db.session.execute(query).all()
        end_read()
        if not rows:
            break
        after = (rows[-1][1], rows[-1][0])
        ids = [row[0] for row in rows if not row[2]]
        kept += len(rows) - len(ids)
        if ids:
            # The DELETE checks again: a row that changed since the read (a
            # delivery requeued) is left alone. On SQLite it opens the write
            # transaction itself.
            statement = delete(table).where(table.c.id.in_(ids), *old)
            if blocked is not None:
                statement = statement.where(not_(blocked))
            # Each batch is its own unit of work: a long purge never holds
            # the write lock for more than one batch.
            with unit_of_work() as session:
                if lock_first is not None and not is_sqlite():
                    # PostgreSQL: the DELETE's check reads its snapshot, so a
                    # delivery set pending by a replay, or a conflict kept,
                    # that commits while the DELETE waits on it would go
                    # with its event. Locked first, such a write has
                    # committed before the DELETE starts, and its snapshot
                    # sees it.
                    for lock in lock_first(ids):
                        session.execute(lock)
                # A DELETE's result is a CursorResult; Session.execute is typed wider.
                deleted += cast(CursorResult[Any], session.execute(statement)).rowcount
        if len(rows) < batch_size:
            break
    return deleted, kept


def purge(now: datetime, batch_size: int) -> PurgeReport:
    """Delete everything past its lifetime as of ``now``, ``batch_size`` rows at a time."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    config = current_app.config
    report = PurgeReport()
    needed = _still_needed(_events.c.id)
    for scope in _scopes(_events.c.source, now, config, with_clients=True):
        deleted, kept = _purge_scope(
            _events,
            _events.c.received_at,
            scope,
            batch_size,
            blocked=needed,
            lock_first=_lock_events,
        )
        report.events += deleted
        report.events_kept += kept
        if deleted:
            report.per_source[scope.label] = deleted
    while True:
        with unit_of_work():
            purged = records.purge_expired_batch(now, batch_size)
        report.idempotency_records += purged
        if purged < batch_size:
            break
    for scope in _scopes(_rejections.c.source, now, config, with_clients=False):
        report.rejections += _purge_scope(
            _rejections, _rejections.c.received_at, scope, batch_size
        )[0]
    everyone = _Scope(
        "admin",
        _login_failures.c.id.is_not(None),
        now - timedelta(days=_days(config, "DEFAULT_RETENTION_DAYS")),
    )
    report.login_failures = _purge_scope(
        _login_failures, _login_failures.c.at, everyone, batch_size
    )[0]
    return report


@click.command("purge")
@with_appcontext
@click.option("--batch-size", type=int, default=None, help="Rows deleted per transaction.")
def purge_command(batch_size: int | None) -> None:
    """Delete events past their retention and expired idempotency records, in batches."""
    size = int(current_app.config["PURGE_BATCH_SIZE"]) if batch_size is None else batch_size
    if size < 1:
        raise click.BadParameter("must be at least 1", param_hint="--batch-size")
    report = purge(datetime.now(UTC), size)
    detail = ", ".join(f"{name}: {n}" for name, n in sorted(report.per_source.items()))
    click.echo(
        f"purged {report.events} event(s) past retention" + (f" ({detail})" if detail else "")
    )
    if report.events_kept:
        click.echo(
            f"kept {report.events_kept} event(s) past retention: "
            "a delivery not delivered, skipped or discarded yet, "
            "or a conflict not reviewed yet"
        )
    click.echo(f"purged {report.idempotency_records} expired idempotency record(s)")
    click.echo(f"purged {report.rejections} rejection(s) past retention")
    click.echo(f"purged {report.login_failures} admin login failure(s) past retention")


def init_app(app: Flask) -> None:
    """Register the purge command."""
    app.cli.add_command(purge_command)
