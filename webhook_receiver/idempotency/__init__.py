"""The Idempotency-Key engine: claim a key, run the view once, replay the response."""

from __future__ import annotations

from .decorator import Refused, idempotent

__all__ = ["Refused", "idempotent"]
