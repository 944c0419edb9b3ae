"""The inbox's tables, and the columns its writes fill, in the order its statements bind them."""

from __future__ import annotations

from ..models import Delivery, Event, EventConflict, utcnow
from ..outbox.deliveries import new_delivery_columns

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
