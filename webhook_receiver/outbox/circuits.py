"""A forward target's circuit breaker and rate limit, as a record every worker shares.

A target is one consumer of one source (``delivery_targets``, one row per
target once it has failed or sent under a rate limit; no row is a closed
circuit). The circuit is a state machine:

- ``closed``: deliveries go; each failure counts, each answer resets the
  count. The ``failures``-th failure in a row opens it (one conditional
  upsert decides, so one worker sees it open).
- ``open``: no delivery is attempted until ``retry_at`` (the cool-down's
  end); the target's pending deliveries are moved to then.
- ``half_open``: the cool-down is over and one attempt, the probe, holds
  ``probe_token`` until ``probe_expires_at``: it closes the circuit or opens
  it again for another cool-down. A probe whose worker died is taken over
  once ``probe_expires_at`` has passed.

The rate limit is GCRA (the generic cell rate algorithm): ``next_send_at``
is the target's theoretical arrival time; a send is allowed while it is at
most the tolerance (one second's burst) ahead of now, and moves it one
interval on, in one conditional UPDATE.

Data access only: nothing here commits; the worker's gates
(``processing/limits.py``) own the transactions.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, and_, case, exists, literal, or_, select, update

from ..database import dialect_insert
from ..extensions import db
from ..models import Delivery, DeliveryTarget, Event
from .deliveries import PENDING, Claim

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
STATES = (CLOSED, OPEN, HALF_OPEN)

_t = DeliveryTarget.__table__
_d = Delivery.__table__


@dataclass(frozen=True)
class Circuit:
    """A target's circuit as read: its state, failures in a row, and its times."""

    source: str
    consumer: str
    state: str = CLOSED
    failures: int = 0
    opened_at: datetime | None = None
    retry_at: datetime | None = None
    probe_expires_at: datetime | None = None

    @property
    def is_open(self) -> bool:
        """Open or half-open: ``webhook_receiver_circuit_open`` is 1."""
        return self.state != CLOSED


def _target(source: str, consumer: str) -> Any:
    return and_(_t.c.source == source, _t.c.consumer == consumer)


def _when(value: datetime | None) -> Any:
    # Bound with the column's type, so that it is stored as naive UTC.
    return literal(value, _t.c.retry_at.type)


# The columns of a target's circuit that the worker reads with its event
# (``joined``): state, failures, opened, cool-down's end, probe's end.
COLUMNS = (_t.c.circuit, _t.c.failures, _t.c.opened_at, _t.c.retry_at, _t.c.probe_expires_at)


def joined(consumer: str) -> Any:
    """The events table with the row of each event's target for ``consumer``, if it has one.

    The worker reads a claimed delivery's circuit (``COLUMNS``) in the same
    statement as its event: no round trip of its own.
    """
    return Event.__table__.outerjoin(
        _t, and_(_t.c.source == Event.source, _t.c.consumer == consumer)
    )


def of_row(source: str, consumer: str, values: Any) -> Circuit:
    """The circuit from ``COLUMNS``' values (all None: no row, so closed and clean)."""
    if values[0] is None:
        return Circuit(source, consumer)
    return Circuit(source, consumer, *values)


def read(source: str, consumer: str) -> Circuit:
    """The target's circuit (closed, with no failure, when it has no row)."""
    row = db.session.execute(select(*COLUMNS).where(_target(source, consumer))).one_or_none()
    return of_row(source, consumer, row or (None,))


def read_all() -> list[Circuit]:
    """Every target's circuit that has a row."""
    rows = db.session.execute(
        select(
            _t.c.source,
            _t.c.consumer,
            _t.c.circuit,
            _t.c.failures,
            _t.c.opened_at,
            _t.c.retry_at,
            _t.c.probe_expires_at,
        ).order_by(_t.c.source, _t.c.consumer)
    ).all()
    return [Circuit(*row) for row in rows]


def fail(source: str, consumer: str, now: datetime, threshold: int, retry_at: datetime) -> bool:
    """Count a failure of a closed circuit; True if it was the one that opened it.

    One upsert: a failure of a circuit that is not closed (an attempt that
    started before it opened) counts nothing.
    """
    opens = _t.c.failures + 1 >= threshold
    first_opens = threshold <= 1
    statement = (
        dialect_insert(_t)
        .values(
            source=source,
            consumer=consumer,
            circuit=OPEN if first_opens else CLOSED,
            failures=1,
            opened_at=now if first_opens else None,
            retry_at=retry_at if first_opens else None,
            updated_at=now,
        )
        .on_conflict_do_update(
            index_elements=[_t.c.source, _t.c.consumer],
            set_={
                "failures": _t.c.failures + 1,
                "circuit": case((opens, OPEN), else_=CLOSED),
                "opened_at": case((opens, _when(now)), else_=_when(None)),
                "retry_at": case((opens, _when(retry_at)), else_=_when(None)),
                "updated_at": now,
            },
            where=_t.c.circuit == CLOSED,
        )
        .returning(_t.c.circuit)
    )
    state = db.session.execute(statement).scalar_one_or_none()
    return state == OPEN


def answered(source: str, consumer: str, now: datetime) -> bool:
    """The target answered: a closed circuit's failures go back to 0. True if there were some."""
    result = db.session.execute(
        update(_t)
        .where(_target(source, consumer), _t.c.circuit == CLOSED, _t.c.failures > 0)
        .values(failures=0, updated_at=now)
    )
    return _rowcount(result) == 1


def take_probe(source: str, consumer: str, token: str, now: datetime, until: datetime) -> bool:
    """Make this attempt the probe of an open circuit whose cool-down is over; False if not.

    Only one worker gets it: an open circuit past ``retry_at``, or a
    half-open one whose probe's time ran out (its worker died).
    """
    result = db.session.execute(
        update(_t)
        .where(
            _target(source, consumer),
            or_(
                and_(_t.c.circuit == OPEN, _t.c.retry_at <= now),
                and_(_t.c.circuit == HALF_OPEN, _t.c.probe_expires_at <= now),
            ),
        )
        .values(circuit=HALF_OPEN, probe_token=token, probe_expires_at=until, updated_at=now)
    )
    return _rowcount(result) == 1


def close(source: str, consumer: str, token: str, now: datetime) -> bool:
    """The probe holding ``token`` was answered: close the circuit; False if it lost the probe."""
    result = db.session.execute(
        update(_t)
        .where(_target(source, consumer), _t.c.circuit == HALF_OPEN, _t.c.probe_token == token)
        .values(
            circuit=CLOSED,
            failures=0,
            opened_at=None,
            retry_at=None,
            probe_token=None,
            probe_expires_at=None,
            updated_at=now,
        )
    )
    return _rowcount(result) == 1


def reopen(source: str, consumer: str, token: str, now: datetime, retry_at: datetime) -> bool:
    """The probe holding ``token`` failed: open the circuit for another cool-down."""
    result = db.session.execute(
        update(_t)
        .where(_target(source, consumer), _t.c.circuit == HALF_OPEN, _t.c.probe_token == token)
        .values(
            circuit=OPEN,
            failures=_t.c.failures + 1,
            retry_at=retry_at,
            probe_token=None,
            probe_expires_at=None,
            updated_at=now,
        )
    )
    return _rowcount(result) == 1


def hold_pending(source: str, consumer: str, until: datetime, now: datetime) -> int:
    """Move the target's pending deliveries due before ``until`` to then; how many moved.

    An open circuit's backlog then waits out the cool-down without being
    claimed, held back and claimed again by every worker.
    """
    of_source = exists().where(Event.id == _d.c.event_id, Event.source == source)
    result = db.session.execute(
        update(_d)
        .where(
            _d.c.state == PENDING,
            _d.c.consumer == consumer,
            _d.c.next_attempt_at < until,
            of_source,
        )
        .values(next_attempt_at=until, updated_at=now)
    )
    return _rowcount(result)


def hold_back(claim: Claim, now: datetime, until: datetime) -> bool:
    """Give a claimed delivery back unattempted, due at ``until``; False if the lease was lost.

    Its attempt is not counted: the claim's increment is undone.
    """
    result = db.session.execute(
        update(_d)
        .where(_d.c.id == claim.id, _d.c.lease_token == claim.token)
        .values(
            state=PENDING,
            attempts=_d.c.attempts - 1,
            next_attempt_at=until,
            lease_token=None,
            lease_expires_at=None,
            updated_at=now,
        )
    )
    return _rowcount(result) == 1


@dataclass(frozen=True)
class Slot:
    """A rate limit's answer: send after ``wait`` seconds, or (None) not before ``ready``."""

    wait: float | None
    ready: float = 0.0


def take_slot(
    source: str, consumer: str, when: datetime, per_second: float, max_wait: float
) -> Slot:
    """Reserve the target's next send under its rate limit, at most ``max_wait`` seconds ahead.

    The burst allowed is one second's worth (``per_second`` sends at once
    after a quiet second). ``Slot.ready`` is in seconds since the epoch.
    """
    now = when.timestamp()
    interval = 1.0 / per_second
    # A millisecond's slack: times near 1.8e9 s carry rounding of about 2e-7 s
    # per addition, which must not turn a send on its boundary away.
    tolerance = max(0.0, 1.0 - interval) + 0.001
    for _ in range(2):
        sent = db.session.execute(
            update(_t)
            .where(
                _target(source, consumer),
                or_(
                    _t.c.next_send_at.is_(None),
                    _t.c.next_send_at <= now + tolerance + max_wait,
                ),
            )
            .values(
                next_send_at=case(
                    (
                        or_(_t.c.next_send_at.is_(None), _t.c.next_send_at < now),
                        literal(now, _t.c.next_send_at.type),
                    ),
                    else_=_t.c.next_send_at,
                )
                + interval
            )
            .returning(_t.c.next_send_at)
        ).scalar_one_or_none()
        if sent is not None:
            return Slot(wait=max(0.0, sent - interval - tolerance - now))
        ahead = db.session.execute(
            select(_t.c.next_send_at).where(_target(source, consumer))
        ).one_or_none()
        if ahead is not None:
            return Slot(wait=None, ready=float(ahead[0]) - tolerance - max_wait)
        # The target's first send: its row, then the reservation again.
        db.session.execute(
            dialect_insert(_t)
            .values(
                source=source,
                consumer=consumer,
                circuit=CLOSED,
                failures=0,
                updated_at=when,
            )
            .on_conflict_do_nothing(index_elements=[_t.c.source, _t.c.consumer])
        )
    raise RuntimeError("the rate limit's row could not be written")  # pragma: no cover


def _rowcount(result: Any) -> int:
    # An UPDATE's result is a CursorResult; Session.execute is typed wider.
    return cast(CursorResult[Any], result).rowcount
