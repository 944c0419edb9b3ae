"""Backing off through an outage (the broker, the database, a missing queue), logging it once."""

from __future__ import annotations

import logging
import random
import time

from ..database import damage_message, is_damaged

log = logging.getLogger("webhook_receiver.brokers")


class SourceNotReady(Exception):
    """The source cannot run as configured yet (a missing queue or stream): it waits and retries.

    The other sources of the process, and the web server beside it, go on.
    """


class Outage:
    """One cause of outage of one consumer (``what``: broker, database, queue...).

    Each cause has its own record, so that the end of one (a batch stored:
    the database is back) never ends, or times, another (the broker still
    away). The first failure is logged as the outage's start, each later
    one as a line of its own (one per attempt, with the wait before the
    next), and the recovery with the outage's true length.
    """

    def __init__(self, source: str, what: str, *, first: float = 0.5, cap: float = 30.0) -> None:
        self.source = source
        self.what = what
        self.first = first
        self.cap = cap
        self.since: float | None = None
        self.attempts = 0
        self._next = first

    def failed(self, error: BaseException | str) -> float:
        """Record a failure; return how long to wait before the next attempt."""
        delay = self._next
        self._next = min(self._next * 2, self.cap)
        # Jitter, so that consumers cut off together do not come back together.
        delay *= 0.5 + random.random() / 2
        extra = {"source": self.source, "outage": self.what}
        # A damaged database is no outage a wait ends: an operator must
        # restore it, so each line is an ERROR naming the damage.
        cause = error.__cause__ if isinstance(error, BaseException) else None
        damaged = next(
            (e for e in (error, cause) if isinstance(e, BaseException) and is_damaged(e)), None
        )
        level = logging.WARNING
        if damaged is not None:
            level, error = logging.ERROR, damage_message(damaged)
        if self.since is None:
            self.since = time.monotonic()
            self.attempts = 1
            log.log(
                level,
                "source %s: %s unavailable, backing off and retrying: %s",
                self.source,
                self.what,
                error,
                extra=extra,
            )
        else:
            self.attempts += 1
            log.log(
                level,
                "source %s: %s still unavailable after %.1f s (attempt %d, next in %.1f s): %s",
                self.source,
                self.what,
                time.monotonic() - self.since,
                self.attempts,
                delay,
                error,
                extra=extra,
            )
        return delay

    def recovered(self) -> None:
        """Record a success; log the end of the outage if one was on."""
        if self.since is not None:
            log.info(
                "source %s: %s back after %.1f s",
                self.source,
                self.what,
                time.monotonic() - self.since,
                extra={"source": self.source, "outage": self.what},
            )
        self.since = None
        self._next = self.first
