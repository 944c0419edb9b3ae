"""``flask --app wsgi deliveries``: an event's attempts, and replays of one event or many.

- ``deliveries attempts EVENT_ID``: each delivery of the event with its
  attempts (when, outcome, status or confirmation, latency, error).
- ``deliveries replay --event ID [--consumer NAME] [--new-key]``: send one
  event again to one consumer or all of them, whatever the delivery's state.
- ``deliveries replay [--consumer] [--source] [--type] [--state] [--since]
  [--until] [--limit N] [--new-key] [--dry-run] [--yes]``: a bulk replay
  by filter; it prints the count first, then asks (``--yes`` does not ask,
  ``--dry-run`` stops after the count).
"""

from __future__ import annotations

import getpass
import math
import socket
from datetime import UTC, datetime
from typing import Any

import click
from flask.cli import with_appcontext

from ..extensions import db
from ..outbox import attempts, replays
from ..outbox.replays import Filter
from . import replay

# Ids and counts are signed 64-bit in the database: a larger number names no
# row, and the drivers refuse to bind it (a traceback, not an answer).
_ID = click.IntRange(min=1, max=2**63 - 1)
_COUNT = click.IntRange(min=1, max=2**63 - 1)


def _text(ctx: click.Context, param: click.Parameter, value: str) -> str:
    # PostgreSQL refuses a NUL in any text it is sent; no name holds one.
    if value and "\x00" in value:
        raise click.BadParameter("holds a NUL character")
    return value


def _rest(ctx: click.Context, param: click.Parameter, value: float) -> float:
    # NaN passes FloatRange(min=0) (it compares false with everything), and
    # infinity passes it too: either would end the replay after its first
    # batch (time.sleep refuses NaN) or never end it.
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


@click.group("deliveries")
def deliveries_group() -> None:
    """Look at delivery attempts; send events again (replay)."""


@deliveries_group.command("attempts")
@with_appcontext
@click.argument("event_id", type=_ID)
def attempts_command(event_id: int) -> None:
    """Print each delivery of EVENT_ID with its attempts, oldest first."""
    try:
        logs = attempts.of_event(event_id)
    finally:
        db.session.rollback()
    if not logs:
        raise click.ClickException(f"event {event_id} has no deliveries (or does not exist)")
    for delivery in logs:
        click.echo(
            f"delivery {delivery.id} to {delivery.consumer} ({delivery.kind}): {delivery.state}, "
            f"{_count(len(delivery.attempts), 'attempt')}"
        )
        for row in delivery.attempts:
            click.echo("  " + _attempt_line(row))


def _attempt_line(row: Any) -> str:
    answer = str(row.status) if row.status is not None else (row.confirmation or "-")
    parts = [
        f"#{row.number}",
        _iso(row.started_at),
        row.outcome,
        answer,
        f"{row.latency_ms:.1f} ms",
    ]
    if row.replay_id is not None:
        parts.append(f"replay {row.replay_id}")
    line = "  ".join(parts)
    error = (row.error or "").strip()
    if error:
        line += f"  error: {error.splitlines()[0][:300]}"
    return line


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _deliveries(n: int) -> str:
    return f"{n:,} {'delivery' if n == 1 else 'deliveries'}"


def _moment(value: str | None, name: str) -> datetime | None:
    if not value:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise click.BadParameter(
            f"{value!r} is not an ISO 8601 date and time (2026-12-01T08:00Z)", param_hint=name
        ) from exc
    # A time without a zone is UTC, as everywhere in the receiver.
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    try:
        # In UTC now, as it is bound: a time whose offset takes it past year
        # 1 or 9999 cannot be (a traceback from the driver otherwise).
        return moment.astimezone(UTC)
    except OverflowError as exc:
        raise click.BadParameter(
            f"{value!r} is out of range once in UTC (years 1 to 9999)", param_hint=name
        ) from exc


def actor() -> str:
    """Who runs this command: the OS user and host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown user"
    return f"{user}@{socket.gethostname()}"


@deliveries_group.command("replay")
@with_appcontext
@click.option("--event", "event_id", type=_ID, help="Replay this event only.")
@click.option("--consumer", default="", callback=_text, help="Only deliveries to this consumer.")
@click.option("--source", default="", callback=_text, help="Only events of this source (bulk).")
@click.option(
    "--type", "event_type", default="", callback=_text, help="Only events of this type (bulk)."
)
@click.option(
    "--state", type=click.Choice(replays.STATES), help="Only deliveries in this state (bulk)."
)
@click.option("--since", help="Only events received at or after this time (ISO 8601, UTC).")
@click.option("--until", help="Only events received before this time (ISO 8601, UTC).")
@click.option("--limit", type=_COUNT, help="Replay at most this many (bulk).")
@click.option(
    "--new-key", is_flag=True, help="Send with a new key: ':replay-<n>' after the usual one."
)
@click.option("--dry-run", is_flag=True, help="Print how many would be replayed, and stop.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (bulk).")
@click.option(
    "--rest",
    type=click.FloatRange(min=0),
    callback=_rest,
    default=replay.REST,
    show_default=True,
    help="After each batch, wait this many times as long as it took (bulk): "
    "leaves the database to the intake.",
)
def replay_command(
    event_id: int | None,
    consumer: str,
    source: str,
    event_type: str,
    state: str | None,
    since: str | None,
    until: str | None,
    limit: int | None,
    new_key: bool,
    dry_run: bool,
    yes: bool,
    rest: float,
) -> None:
    """Send events again, whatever their deliveries' state: one event, or many by a filter."""
    who = actor()
    if event_id is not None:
        bulk_only = {
            "--source": source,
            "--type": event_type,
            "--state": state,
            "--since": since,
            "--until": until,
            "--limit": limit,
            "--dry-run": dry_run,
        }
        given = [name for name, value in bulk_only.items() if value]
        if given:
            raise click.UsageError(f"--event replays one event: {', '.join(given)} do not apply")
        try:
            done = replay.replay_event(
                event_id, consumer, actor=who, via=replays.VIA_CLI, new_key=new_key
            )
        except replay.ReplayError as exc:
            raise click.ClickException(str(exc)) from exc
        _report(done, new_key)
        if not new_key:
            click.echo(f"note: {replay.SAME_KEY_WARNING} (--new-key)")
        return
    flt = Filter(
        consumer=consumer,
        source=source,
        event_type=event_type,
        state=state or "",
        since=_moment(since, "--since"),
        until=_moment(until, "--until"),
    )
    plan = replay.preview(flt, limit=limit)
    click.echo(f"{_deliveries(plan.count)} match" + ("es" if plan.count == 1 else ""))
    if dry_run or plan.count == 0:
        return
    if not new_key:
        click.echo(f"note: {replay.SAME_KEY_WARNING} (--new-key)")
    if not yes:
        click.confirm(f"Replay {_deliveries(plan.count)}?", abort=True)
    try:
        done = replay.run(plan, actor=who, via=replays.VIA_CLI, new_key=new_key, rest=rest)
    except replay.Interrupted as exc:
        raise click.ClickException(str(exc)) from exc
    _report(done, new_key)


def _report(done: replay.Done, new_key: bool) -> None:
    by_consumer = ", ".join(f"{name}: {n:,}" for name, n in sorted(done.consumers.items()))
    click.echo(
        f"replay {done.replay_id}: queued {_deliveries(done.replayed)} again"
        + (f" ({by_consumer})" if by_consumer else "")
        + (", each with a new key" if new_key else "")
    )
    if done.left_alone:
        click.echo(
            f"{_deliveries(done.left_alone)} left alone: in progress at a worker, or gone since"
        )
