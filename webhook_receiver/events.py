"""Reading stored events, and the header redaction every intake applies before storing."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from .extensions import db
from .models import Event

# Header values that authenticate or sign a request are never stored: these
# names, any name matching SECRET_NAME (X-Api-Key, X-Auth-Token,
# X-Gitlab-Token, X-Shopify-Hmac-Sha256, ...), and each provider's own.
ALWAYS_REDACTED = frozenset(
    {"authorization", "cookie", "set-cookie", "proxy-authorization", "x-amz-security-token"}
)
SECRET_NAME = re.compile(
    r"token|secret|signature|passw|api[-_]?key|access[-_]?key|auth|session|cookie|credential|hmac",
    re.IGNORECASE,
)
REDACTED = "[redacted]"


@functools.lru_cache(maxsize=1024)  # names repeat from request to request; bounded for the rest
def is_secret_header(name: str) -> bool:
    """Tell whether a header's name says its value may carry a credential."""
    return name.lower() in ALWAYS_REDACTED or SECRET_NAME.search(name) is not None


def redact_headers(
    headers: Iterable[tuple[str, str]], secret_names: Iterable[str] = ()
) -> tuple[tuple[str, str], ...]:
    """Return the headers as (name, value) pairs with secret-bearing values redacted."""
    listed = {name.lower() for name in secret_names}
    return tuple(
        (name, REDACTED if name.lower() in listed or is_secret_header(name) else value)
        for name, value in headers
    )


def get_event(event_id: int) -> Event | None:
    """Load one event by id."""
    return db.session.get(Event, event_id)


def to_json(event: Event, data: Any) -> dict[str, Any]:
    """The API's representation of an event."""
    return {
        "id": event.id,
        "type": event.event_type,
        "source": event.source,
        "data": data,
        "received_at": iso(event.received_at),
        "duplicate_count": event.duplicate_count,
    }


def iso(moment: datetime | None) -> str | None:
    """Format an aware UTC datetime as RFC 3339 with a Z."""
    if moment is None:
        return None
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")
