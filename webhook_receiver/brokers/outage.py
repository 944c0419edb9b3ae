"""Backing off through an outage (database or broker), logging it once."""

from __future__ import annotations

import logging
import random
import time

log = logging.getLogger("webhook_receiver.brokers")


class FatalConsumerError(Exception):
    """The consumer cannot run as configured (a missing queue or stream): it stops."""


class Outage:
    """The state of one consumer's current outage: when it began and the next wait."""

    def __init__(self, source: str, *, first: float = 0.5, cap: float = 30.0) -> None:
        self.source = source
        self.first = first
        self.cap = cap
        self.since: float | None = None
        self.what: str | None = None
        self._next = first

    def failed(self, what: str, error: BaseException | str) -> float:
        """Record a failure; return how long to wait. Logged once per outage and cause."""
        if self.since is None or self.what != what:
            log.warning(
                "source %s: %s unavailable, backing off and retrying: %s",
                self.source,
                what,
                error,
                extra={"source": self.source, "outage": what},
            )
            self.since = self.since or time.monotonic()
            self.what = what
        delay = self._next
        self._next = min(self._next * 2, self.cap)
        # Jitter, so that consumers cut off together do not come back together.
        return delay * (0.5 + random.random() / 2)

    def recovered(self) -> None:
        """Record a success; log the end of an outage if one was on."""
        if self.since is not None:
            log.info(
                "source %s: %s back after %.1f s",
                self.source,
                self.what,
                time.monotonic() - self.since,
                extra={"source": self.source, "outage": self.what},
            )
        self.since = None
        self.what = None
        self._next = self.first
