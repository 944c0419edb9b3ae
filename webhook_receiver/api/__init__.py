"""The client API: events posted with an Idempotency-Key."""

from __future__ import annotations

from . import replays  # noqa: F401  (counts replays as duplicates, on bp)
from .views import bp

__all__ = ["bp"]
