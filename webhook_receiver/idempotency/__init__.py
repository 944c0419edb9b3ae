"""The Idempotency-Key engine: claim a key, run the view once, replay the response."""

from __future__ import annotations

from .decorator import idempotent

__all__ = ["idempotent"]
