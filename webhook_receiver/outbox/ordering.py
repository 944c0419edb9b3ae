"""Ordering by entity version: an event older than one already applied is skipped.

A source with ``version = "json:/data/object/version"`` and
``entity = "json:/data/object/id"`` is ordered. The newest applied version is
kept per consumer and entity, since consumers may filter event types
differently: the ``entity_versions`` row's ``entity`` is
``<consumer>:<entity id>`` (consumer names hold no ``:``).

Versions compare as numbers when they are numbers (or digit strings), else as
strings (ISO 8601 timestamps of one format sort right). They are stored in a
form whose string order is that order, so the database can decide in one
conditional statement.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from sqlalchemy import exists

from .. import pointers
from ..database import is_sqlite
from ..extensions import db
from ..models import EntityVersion
from . import deliveries
from .deliveries import Claim

log = logging.getLogger(__name__)
_t = EntityVersion.__table__
_NUMBER = re.compile(r"^[0-9]+(\.[0-9]+)?$")
_MAX_NUMBER = Decimal(10) ** 24
STALE = "stale: a newer version of this entity was already applied"


@dataclass(frozen=True)
class Key:
    """Where one event stands: its entity (qualified by consumer) and sortable version."""

    entity: str
    version: str


def sortable(value: Any) -> str | None:
    """Encode a version so that string order is version order; None if unusable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float) or (isinstance(value, str) and _NUMBER.match(value)):
        try:
            number = Decimal(str(value))
        except InvalidOperation:
            return None
        if not number.is_finite() or number < 0 or number >= _MAX_NUMBER:
            return None
        return "n" + format(number, "034.9f")
    if isinstance(value, str) and 0 < len(value) < 100:
        return "s" + value
    return None


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
