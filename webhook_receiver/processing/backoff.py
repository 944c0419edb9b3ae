"""When to try a failed delivery again: exponential backoff with jitter, or Retry-After.

The schedule lives in the database (``next_attempt_at``), not in a sleeping
process, so an in-process retry library does not fit: this is one function.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

# Worth retrying: the downstream is overloaded, timed out or broken for now.
RETRYABLE_STATUSES = frozenset({408, 429})
# No retry waits longer than a century: next_attempt_at stays a date.
MAX_DELAY_SECONDS = 100 * 365.25 * 24 * 3600


def is_retryable_status(status: int) -> bool:
    """Tell whether an HTTP status is a transient failure (5xx, 408, 429)."""
    return status >= 500 or status in RETRYABLE_STATUSES


def delay_seconds(
    attempt: int,
    *,
    base: float,
    cap: float,
    retry_after: float | None = None,
    retry_after_cap: float = 24 * 3600,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (from 1).

    The exponential step ``base * 2**(attempt - 1)``, capped at ``cap``, is
    jittered into [step/2, step] so that deliveries failed together do not
    retry together. A ``Retry-After`` from the downstream is a floor: never
    sooner than it asked, up to ``retry_after_cap``.
    """
    # Past 2**63 every step is the cap: a forward allowed thousands of
    # attempts reached 2**1024, which no float holds (OverflowError).
    step = min(cap, base * 2 ** min(max(0, attempt - 1), 63))
    delay = step / 2 + rand() * step / 2
    if retry_after is not None:
        delay = max(delay, min(retry_after, retry_after_cap))
    # Caps set past any date (inf, 1e15): the retry's time must be one.
    return min(delay, MAX_DELAY_SECONDS)


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Read a Retry-After header (delay-seconds or an HTTP date) as seconds from ``now``."""
    if not value:
        return None
    value = value.strip()
    # ASCII only: str.isdigit() also accepts digits float() refuses ("²").
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - now).total_seconds())
