"""The processing tests' fake clock, for the outbox's tests that store events at a set time."""

from __future__ import annotations

from ..processing.conftest import clock  # noqa: F401  (a fixture, used by name)
