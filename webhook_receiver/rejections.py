"""Refused deliveries (bad signature, stale timestamp), recorded for operators.

Recording a refusal must never turn it into a 5xx: if the database is away,
the 401 still stands.
"""

from __future__ import annotations

import logging

from sqlalchemy import insert

from .extensions import db
from .models import Rejection, utcnow

log = logging.getLogger(__name__)


def record(source: str, reason: str, detail: str, remote_addr: str | None) -> None:
    """Store one refused delivery of ``source``; log, never raise, if it cannot be stored."""
    try:
        db.session.execute(
            insert(Rejection.__table__).values(
                source=source,
                reason=reason,
                detail=detail[:500],
                remote_addr=(remote_addr or "")[:100] or None,
                received_at=utcnow(),
            )
        )
        db.session.commit()
    except Exception:
        db.session.rollback()
        log.warning("could not record a refused delivery", exc_info=True)
