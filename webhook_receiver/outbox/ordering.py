"""Ordering by entity version: an event older than one already applied is skipped.

A source with ``version = "json:/data/object/version"`` and
``entity = "json:/data/object/id"`` is ordered. The newest applied version is
kept per consumer and entity, since consumers may filter event types
differently: the ``entity_versions`` row's ``entity`` is
``<consumer>:<entity id>`` (consumer names hold no ``:``).

Versions compare as numbers when they are numbers (or digit strings), as
instants when they are RFC 3339 timestamps with an offset (``Z`` or
``+02:00``: any offset, any digits of a second's fraction), else as strings.
They are stored in a form whose string order is that order, so the database
can decide in one conditional statement.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Context, Decimal, InvalidOperation
from typing import Any

from sqlalchemy import exists

from .. import pointers
from ..database import is_sqlite
from ..extensions import db
from ..models import Delivery, EntityVersion
from . import deliveries
from .deliveries import Claim

log = logging.getLogger(__name__)
_t = EntityVersion.__table__
_d = Delivery.__table__
_NUMBER = re.compile(r"^[0-9]+(\.[0-9]+)?$")
_MAX_NUMBER = Decimal(10) ** 24
_NANO = Decimal("1e-9")
_WIDE = Context(prec=40)
# RFC 3339's date-time: a fraction's digits vary and '.' sorts below 'Z' and
# the offsets, so as strings a later instant could sort first.
_TIMESTAMP = re.compile(
    r"^([0-9]{4}-[0-9]{2}-[0-9]{2})[Tt ]([0-9]{2}:[0-9]{2}:[0-9]{2})(?:\.([0-9]{1,9}))?"
    r"(?:([Zz])|([+-])([0-9]{2}):([0-9]{2}))$"
)
STALE = "stale: a newer version of this entity was already applied"


@dataclass(frozen=True)
class Key:
    """Where one event stands: its entity (qualified by consumer) and sortable version."""

    entity: str
    version: str


def sortable(value: Any) -> str | None:
    """Encode a version so that string order is version order; None if unusable.

    Negative numbers ("m") sort below the others ("n"), numbers below
    timestamps ("t", after the strings, so that a row written when
    timestamps compared as strings is taken for older, not newer), strings
    ("s") between.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float) or (isinstance(value, str) and _NUMBER.match(value)):
        try:
            number = Decimal(str(value))
        except InvalidOperation:
            return None
        if not number.is_finite() or abs(number) >= _MAX_NUMBER:
            return None
        # To the nanosecond, in a context with the digits 24 + 9 need.
        number = number.quantize(_NANO, context=_WIDE)
        if number.is_zero():
            number = number.copy_abs()  # -0 is 0
        if number < 0:
            # Complemented: the more negative, the lower.
            return "m" + format(_WIDE.add(_MAX_NUMBER, number), "034.9f")
        return "n" + format(number, "034.9f")
    if isinstance(value, str) and 0 < len(value) < 100:
        return _instant(value) or "s" + value
    return None


def _instant(value: str) -> str | None:
    """An RFC 3339 timestamp as its UTC instant to the nanosecond; None if not one."""
    match = _TIMESTAMP.match(value)
    if match is None:
        return None
    day, time, fraction, utc, sign, hours, minutes = match.groups()
    try:
        instant = datetime.fromisoformat(f"{day}T{time}")
        if not utc:
            offset = timedelta(hours=int(hours), minutes=int(minutes))
            instant -= offset if sign == "+" else -offset
    except (ValueError, OverflowError):
        return None  # not a date (month 13, a leap second), or past year 1 or 9999
    return f"t{instant.isoformat(timespec='seconds')}.{(fraction or '').ljust(9, '0')}"


def key_for(consumer: str, body: bytes, version_pointer: str, entity_pointer: str) -> Key | None:
    """The ordering key of an event's body; None (applied unordered) when it has none."""
    try:
        document = json.loads(body)
    except ValueError as exc:  # UnicodeDecodeError is one
        log.warning("ordered event body is not JSON, applying unordered: %s", exc)
        return None
    version = resolve_pointer(document, version_pointer)
    entity = resolve_pointer(document, entity_pointer)
    encoded = sortable(version)
    if encoded is None or not isinstance(entity, str | int) or isinstance(entity, bool):
        log.warning("event has no usable version/entity, applying unordered")
        return None
    qualified = f"{consumer}:{entity}"
    if len(qualified) > 512:
        log.warning("event's entity is longer than 512 characters, applying unordered")
        return None
    if not (_storable(qualified) and _storable(encoded)):
        # JSON's \u0000 or a lone surrogate escape: PostgreSQL's text holds
        # no NUL and neither database encodes a surrogate, so every attempt
        # would fail on its ordering check.
        log.warning("event's version/entity cannot be stored, applying unordered")
        return None
    return Key(qualified, encoded)


def _storable(text: str) -> bool:
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def resolve_pointer(document: Any, pointer: str) -> Any:
    """Resolve an RFC 6901 JSON pointer; None when nothing is there.

    ``pointers.resolve``: the webhook and broker sources resolve the same way.
    """
    return pointers.resolve(document, pointer)


def skip_if_stale(claim: Claim, source: str, key: Key, now: datetime) -> bool:
    """Mark the delivery skipped when a newer version is applied; the caller commits.

    One fenced UPDATE that is also the transaction's first statement.
    """
    newer = exists().where(
        _t.c.source == source, _t.c.entity == key.entity, _t.c.version > key.version
    )
    return deliveries.mark_skipped(claim, now, STALE, when=newer)


# The version of an entity's row made by take_entity before any is applied:
# below every version (an empty one is never read as a version).
NONE_APPLIED = ""


def take_entity(claim: Claim, source: str, key: Key, now: datetime) -> bool:
    """Name this delivery as the one sending its entity; False while another one is.

    A forward's call is made outside any transaction, between the stale
    check and the version's advance: two workers could send two versions of
    one entity at once, and the older could arrive last. The entity's row
    names the delivery whose call is in flight; it is taken over once that
    one is no longer in flight (delivered, failed, given back, or its lease
    expired), so nothing has to release it: the delivery's own state does.
    An entity with no version applied yet gets its row here. One
    conditional upsert: on PostgreSQL its row lock makes concurrent takers
    wait, then see the winner's name. The caller commits.
    """
    if is_sqlite():
        from sqlalchemy.dialects.sqlite import insert
    else:
        from sqlalchemy.dialects.postgresql import insert  # type: ignore[assignment]
    in_flight = exists().where(
        _d.c.id == _t.c.sending_delivery_id,
        _d.c.id != claim.id,
        _d.c.state == deliveries.IN_PROGRESS,
        _d.c.lease_expires_at > now,
    )
    row = insert(_t).values(
        source=source,
        entity=key.entity,
        version=NONE_APPLIED,
        event_id=None,
        updated_at=now,
        sending_delivery_id=claim.id,
    )
    upsert = row.on_conflict_do_update(
        index_elements=["source", "entity"],
        set_={"sending_delivery_id": claim.id},
        where=~in_flight,
    ).returning(_t.c.id)
    return db.session.execute(upsert).first() is not None


def advance(source: str, key: Key, event_id: int, now: datetime) -> bool:
    """Record this version as applied unless a newer one is; tell whether it was recorded.

    A conditional upsert: on a tie or a newer version the row is updated, on
    an older one it is left alone and nothing is returned. On PostgreSQL the
    row lock it takes orders concurrent deliveries of one entity.
    """
    if is_sqlite():
        from sqlalchemy.dialects.sqlite import insert
    else:
        from sqlalchemy.dialects.postgresql import insert  # type: ignore[assignment]
    row = insert(_t).values(
        source=source, entity=key.entity, version=key.version, event_id=event_id, updated_at=now
    )
    upsert = row.on_conflict_do_update(
        index_elements=["source", "entity"],
        set_={"version": row.excluded.version, "event_id": event_id, "updated_at": now},
        where=_t.c.version <= row.excluded.version,
    ).returning(_t.c.id)
    return db.session.execute(upsert).first() is not None
