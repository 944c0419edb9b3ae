"""The inbox's tables, and the columns its writes fill, in the order its statements bind them."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..models import Delivery, Event, EventConflict, utcnow
from ..outbox.deliveries import new_delivery_columns
from .messages import Message

events = Event.__table__
deliveries = Delivery.__table__
conflicts = EventConflict.__table__

# The columns an intake's message fills; id is the database's.
EVENT_COLUMNS = (
    "source",
    "dedup_key",
    "event_type",
    "fingerprint",
    "content_type",
    "body",
    "headers",
    "meta",
    "correlation_id",
    "client",
    "received_at",
)


def event_row(message: Message, received_at: datetime) -> list[Any]:
    """The values of ``message``'s events row in EVENT_COLUMNS' order (rows.event_values' values).

    For PostgreSQL's batch, whose rows go as JSON arrays: no dict per row,
    and the headers' pairs and a dict of meta go as they are.
    """
    meta = message.meta
    return [
        message.source,
        message.dedup_key,
        message.event_type,
        message.fingerprint,
        message.content_type or None,
        message.body,
        message.headers,
        meta if meta.__class__ is dict else dict(meta),
        message.correlation_id,
        message.client,
        received_at,
    ]


# A new delivery's columns: its event, consumer and kind, then the defaults.
DELIVERY_DEFAULTS = tuple(new_delivery_columns(utcnow()))
DELIVERY_COLUMNS = ("consumer", "kind", *DELIVERY_DEFAULTS)
CONFLICT_COLUMNS = (
    "source",
    "dedup_key",
    "fingerprint",
    "content_type",
    "body",
    "headers",
    "received_at",
)
