"""What the SQS and Pub/Sub consumers share: messages pulled under a lease, settled in a pipeline.

Both brokers hand a message out for a time (SQS's visibility timeout,
Pub/Sub's ack deadline) and take it back unless it is settled in time.
A :class:`PulledConsumer` runs three stages at once, each on its own
thread: this one receives a batch and identifies it, a second stores the
batch before it (the inbox's commit), a third settles the one before that
(deletes or acknowledges, dead letters). Batches are stored, then settled,
one at a time and in order; at most two are past this thread at once.
Every batch is held in :class:`.leases.Leases` from its receipt until it is
settled, so none reappears meanwhile. The database away: the batch is
given back for the back-off (its lease set to it), nothing settled, and
the consumer waits before it takes more.

A subclass speaks its broker: :meth:`receive`, :meth:`give_back`,
:meth:`settle` and :meth:`reader`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from . import batch
from .identify import BrokerMessage
from .leases import Leases

# Batches past the receiving thread at once: one storing, one settling.
IN_FLIGHT = 2


class PulledConsumer(batch.Consumer):
    """A consumer of a broker whose messages are pulled under a lease and settled one by one."""

    def receive(self) -> list[Any]:
        """Up to ``batch`` messages, or none after a short wait."""
        raise NotImplementedError

    def give_back(self, raws: Sequence[Any], seconds: int) -> None:
        """Let the broker hand ``raws`` out again in ``seconds`` (0: at once)."""
        raise NotImplementedError

    def settle(self, raws: list[Any], verdicts: list[batch.Verdict]) -> None:
        """Settle a stored batch by its verdicts (after the commit)."""
        raise NotImplementedError

    def reader(self) -> Callable[[Any], BrokerMessage]:
        """The function that turns one raw message into a BrokerMessage."""
        raise NotImplementedError

    def pipeline(self, leases: Leases) -> None:
        """Receive, store and settle batches until ``stop``; the batches in hand finish first."""
        read = self.reader()
        name = self.source.name
        settling: deque[Future[None]] = deque()
        with (
            ThreadPoolExecutor(1, thread_name_prefix=f"store-{name}") as storer,
            ThreadPoolExecutor(1, thread_name_prefix=f"settle-{name}") as settler,
        ):
            try:
                while not self.stop.is_set():
                    since = time.monotonic()
                    raws = self.receive()
                    if not raws:
                        continue
                    ticket = leases.hold(raws, since)
                    # Identified here (CPU) while the batches before are
                    # stored and settled.
                    prepared = self.prepare_batch(raws, read)
                    while len(settling) >= IN_FLIGHT:
                        settling.popleft().result()
                    stored = storer.submit(self.store_prepared, prepared)
                    settling.append(settler.submit(self._after_store, leases, raws, ticket, stored))
            finally:
                # Stopping or not, the batches in hand are committed and settled first.
                failures = []
                for future in settling:
                    try:
                        future.result()
                    except Exception as exc:
                        failures.append(exc)
                if failures:
                    raise failures[0]

    def _after_store(
        self,
        leases: Leases,
        raws: list[Any],
        ticket: int,
        stored: Future[list[batch.Verdict]],
    ) -> None:
        try:
            try:
                verdicts = stored.result()
            except batch.DatabaseUnavailable as exc:
                # Nothing committed, nothing settled: hidden for the back-off,
                # the batch comes back once it has passed.
                delay = self.database.failed(exc)
                leases.release(ticket)
                self.give_back(raws, max(1, math.ceil(delay)))
                self.stop.wait(delay)
                return
            self.database.recovered()
            self.settle(raws, verdicts)
        finally:
            leases.release(ticket)
