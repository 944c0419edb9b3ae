"""Rows written straight into the tables, for tests that need a stored event as a given."""

from __future__ import annotations

import uuid
from typing import Any

from webhook_receiver.models import utcnow


def event_row(**columns: Any) -> dict[str, Any]:
    """An ``events`` row's values: a fresh key, an empty JSON body, now; ``columns`` override."""
    return {
        "source": "test",
        "dedup_key": uuid.uuid4().hex,
        "fingerprint": "0" * 64,
        "body": b"{}",
        "headers": [],
        "meta": {},
        "received_at": utcnow(),
        **columns,
    }
