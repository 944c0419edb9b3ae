"""Messages in hand kept from coming back: their lease extended until they are settled.

SQS hides a received message for the queue's visibility timeout, Pub/Sub
for the subscription's ack deadline; past it the broker hands the message
to another consumer while this one still stores it. A consumer holds each
batch it received here until it has settled it: one thread extends the
lease of every batch held longer than half its length (SQS's
``ChangeMessageVisibilityBatch``, Pub/Sub's ``ModifyAckDeadline``), so a
store that outlasts it (a stalled database, a long batch) never makes its
messages reappear.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

# How often the keeper looks at the batches held.
TICK_SECONDS = 0.2


class Leases:
    """The batches one consumer holds; extends each lease at half its length until released."""

    def __init__(
        self,
        source: str,
        seconds: int,
        extend: Callable[[Sequence[Any], int], None],
        what: str,
    ) -> None:
        self.source = source
        # The lease's length, and the extension's: the queue's own setting.
        self.seconds = max(1, seconds)
        self._extend = extend
        self._what = what
        self._held: dict[int, tuple[Sequence[Any], float]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._keep, name=f"leases-{source}", daemon=True)
        self._thread.start()

    def hold(self, handles: Sequence[Any], since: float) -> int:
        """Hold a batch received at ``since`` (time.monotonic()); a ticket to release it with."""
        ticket = next(self._ids)
        with self._lock:
            self._held[ticket] = (handles, since)
        return ticket

    def release(self, ticket: int) -> None:
        """The batch is settled (or given back): its lease is no longer extended."""
        with self._lock:
            self._held.pop(ticket, None)

    def close(self) -> None:
        """Stop extending (the consumer's session ends)."""
        self._closed.set()
        self._thread.join(5)

    def _keep(self) -> None:
        while not self._closed.wait(TICK_SECONDS):
            now = time.monotonic()
            with self._lock:
                due = [
                    (ticket, handles)
                    for ticket, (handles, since) in self._held.items()
                    if now - since >= self.seconds / 2
                ]
            for ticket, handles in due:
                try:
                    self._extend(handles, self.seconds)
                except Exception as exc:  # the broker away: the messages may come back
                    log.warning(
                        "source %s: could not extend the %s of %d messages in hand (%s: %s)",
                        self.source,
                        self._what,
                        len(handles),
                        type(exc).__name__,
                        exc,
                        extra={"source": self.source},
                    )
                    continue
                with self._lock:
                    if ticket in self._held:
                        self._held[ticket] = (handles, time.monotonic())
                log.info(
                    "source %s: %d messages held past half their %s: extended by %d s",
                    self.source,
                    len(handles),
                    self._what,
                    self.seconds,
                    extra={"source": self.source},
                )
