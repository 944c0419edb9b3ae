"""The client API: events posted with an Idempotency-Key."""

from __future__ import annotations

from .views import bp

__all__ = ["bp"]
