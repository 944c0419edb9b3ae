"""Kept for the tests that still import ``event_row`` from here: it lives in tests/helpers."""

from __future__ import annotations

from .helpers import event_row

__all__ = ["event_row"]
