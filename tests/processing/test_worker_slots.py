"""The worker's delivery threads as its claiming loop sees them (processing/worker.py's _Slots)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from webhook_receiver.processing.worker import _Slots


def _claim() -> Any:
    return SimpleNamespace(source="stripe-live", consumer="downstream")


def test_a_delivery_that_ends_before_the_loop_waits_is_not_slept_through():
    # The loop claims with the target busy, then waits for a change; the
    # delivery ended in between. Its wake-up must not be lost: the wait
    # returns at once, not a poll later.
    slots = _Slots(SimpleNamespace(), 1)  # type: ignore[arg-type]
    claim = _claim()
    slots.submit(claim)
    seen = slots.changes()
    slots._release(claim)

    started = time.monotonic()
    slots.wait_for_a_change(seen, 30.0)

    assert time.monotonic() - started < 10.0


def test_with_no_change_since_the_claim_the_loop_waits_for_its_poll():
    slots = _Slots(SimpleNamespace(), 1)  # type: ignore[arg-type]
    seen = slots.changes()

    started = time.monotonic()
    slots.wait_for_a_change(seen, 0.2)

    assert time.monotonic() - started >= 0.2
