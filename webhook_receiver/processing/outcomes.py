"""What one delivery attempt came to: the outcome names and the record the hooks get."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

# Outcomes of one attempt.
DELIVERED = "delivered"
RETRY = "retry"
DEAD = "dead"
SKIPPED = "skipped"
LEASE_LOST = "lease_lost"


@dataclass(frozen=True)
class AttemptOutcome:
    """What one delivery attempt came to: logged, and handed to the outcome hooks."""

    delivery_id: int
    event_id: int
    source: str | None
    consumer: str
    kind: str
    dedup_key: str | None
    correlation_id: str | None
    attempt: int
    outcome: str
    status: int | None = None
    error: str | None = None
    duration_seconds: float = 0.0
    next_attempt_at: datetime | None = None

    def log_fields(self) -> dict[str, Any]:
        """The structured fields of this attempt's log line."""
        return {
            "delivery_id": self.delivery_id,
            "event_id": self.event_id,
            "source": self.source,
            "consumer": self.consumer,
            "consumer_kind": self.kind,
            "dedup_key": self.dedup_key,
            "correlation_id": self.correlation_id,
            "attempt": self.attempt,
            "outcome": self.outcome,
            "status": self.status,
            "error": self.error,
            "duration_ms": round(self.duration_seconds * 1000, 1),
            "next_attempt_at": self.next_attempt_at.isoformat() if self.next_attempt_at else None,
        }
