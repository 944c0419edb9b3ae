"""The worker's gates before a forward's call: its target's circuit breaker and rate limit.

Both live in the database (``outbox/circuits.py``), so every worker process
on every host sees one circuit and one rate per target. Before the call,
:meth:`Gates.enter` reads the circuit (an open one in its cool-down, or a
half-open one whose probe is in flight, holds the delivery back), reserves
a send under ``max_per_second`` (a send due within a second, and within
what the lease leaves beyond the call, is waited for here; a later one
holds the delivery back until then), and makes the
attempt the probe of a circuit whose cool-down is over. After it,
:meth:`Gates.leave` records the answer: a retryable failure counts towards
opening the circuit, any answer resets the count, and a probe closes or
reopens it.

A delivery held back is not an attempt: it goes back to ``pending`` with
its attempt count as it was, due when the gate may open, and this process
skips its target's deliveries until then (the claim's ``skip``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from ..config.forwards import ForwardConfig
from ..database import unit_of_work
from ..extensions import db
from ..outbox import circuits
from ..outbox.deliveries import Claim

log = logging.getLogger(__name__)

# The outcome of a delivery a gate held back: no attempt was made.
HELD = "held"
# How long a delivery waits for a circuit's probe in flight before it looks again.
RECHECK_SECONDS = 1.0
# A send the rate limit allows within this many seconds is waited for in the
# delivery's thread (less when its lease is short: _max_wait); a later one
# holds the delivery back.
MAX_WAIT_SECONDS = 1.0

Target = tuple[str, str]


@dataclass(frozen=True)
class Pass:
    """A delivery the gates let through: its target, and what its answer must update."""

    source: str
    consumer: str
    # The claim's token when this attempt is the circuit's probe.
    probe: str | None = None
    # Failures in a row the circuit had when read: an answer resets them.
    failures: int = 0


def _max_wait(claim: Claim, forward: ForwardConfig, now: datetime) -> float:
    """How long this delivery may wait for its rate limit's slot, in its thread.

    At most :data:`MAX_WAIT_SECONDS`, and never into the share of the lease
    the startup check keeps for the call and what follows it (twice the
    forward's timeout): a short timeout's lease may be shorter than the
    wait and the call, and a lease that expires mid-call lets a second
    worker send too. A later slot holds the delivery back instead.
    """
    left = (claim.lease_expires_at - now).total_seconds() - 2 * forward.timeout_seconds
    return max(0.0, min(MAX_WAIT_SECONDS, left))


class Gates:
    """One worker's gates: the database decides; this process remembers what is held back."""

    def __init__(
        self,
        clock: Callable[[], datetime],
        watch: Callable[[str], AbstractContextManager[None]],
        worker: str,
    ) -> None:
        self.clock = clock
        self.watch = watch
        self.worker = worker
        self._held: dict[Target, datetime] = {}
        self._lock = threading.Lock()

    def held(self, now: datetime) -> list[Target]:
        """The targets this process has held back until a time still to come."""
        with self._lock:
            for target in [t for t, until in self._held.items() if until <= now]:
                del self._held[target]
            return list(self._held)

    def enter(
        self,
        claim: Claim,
        source: str,
        forward: ForwardConfig,
        circuit: circuits.Circuit | None = None,
    ) -> Pass | datetime:
        """Let the delivery through (a Pass), or hold it back and say until when.

        ``circuit`` is the target's circuit as read with the event (else it
        is read here).
        """
        now = self.clock()
        name = claim.consumer
        breaker = forward.circuit_breaker
        if breaker is None:
            circuit = circuits.Circuit(source, name)
        elif circuit is None:
            with self.watch("worker circuit read"):
                circuit = circuits.read(source, name)
                db.session.rollback()  # end the read
        if circuit.state == circuits.OPEN and circuit.retry_at and circuit.retry_at > now:
            return self._hold(claim, source, now, circuit.retry_at, "circuit open")
        if (
            circuit.state == circuits.HALF_OPEN
            and circuit.probe_expires_at
            and circuit.probe_expires_at > now
        ):
            until = min(circuit.probe_expires_at, now + timedelta(seconds=RECHECK_SECONDS))
            return self._hold(claim, source, now, until, "circuit probe in flight")
        if forward.max_per_second is not None:
            with self.watch("worker rate limit"), unit_of_work():
                slot = circuits.take_slot(
                    source, name, now, forward.max_per_second, _max_wait(claim, forward, now)
                )
            if slot.wait is None:
                ready = datetime.fromtimestamp(max(slot.ready, now.timestamp()), UTC)
                return self._hold(claim, source, now, ready, "rate limit")
            if slot.wait > 0:
                time.sleep(slot.wait)
        if circuit.state == circuits.CLOSED:
            return Pass(source, name, failures=circuit.failures)
        # The cool-down is over (or the last probe's worker is gone): one probe.
        until = now + timedelta(seconds=2 * forward.timeout_seconds + RECHECK_SECONDS)
        with self.watch("worker circuit probe"), unit_of_work():
            taken = circuits.take_probe(source, name, claim.token, now, until)
        if not taken:
            later = now + timedelta(seconds=RECHECK_SECONDS)
            return self._hold(claim, source, now, later, "circuit probe taken")
        log.info(
            "circuit of %s (%s) half-open: delivery %s is its probe",
            name,
            source,
            claim.id,
            extra=self._fields(source, name, circuit=circuits.HALF_OPEN, delivery_id=claim.id),
        )
        return Pass(source, name, probe=claim.token, failures=circuit.failures)

    def leave(self, gate: Pass, forward: ForwardConfig, *, failed: bool) -> None:
        """Record the call's answer on the circuit: ``failed`` is a retryable failure."""
        breaker = forward.circuit_breaker
        if breaker is None:
            return
        now = self.clock()
        source, name = gate.source, gate.consumer
        if not failed:
            if gate.probe is None and gate.failures == 0:
                return  # closed and clean, as read: nothing to write
            with self.watch("worker circuit"), unit_of_work():
                if gate.probe is None:
                    circuits.answered(source, name, now)
                    return
                closed = circuits.close(source, name, gate.probe, now)
            if closed:
                log.info(
                    "circuit of %s (%s) closed: its probe was answered",
                    name,
                    source,
                    extra=self._fields(source, name, circuit=circuits.CLOSED),
                )
            return
        retry_at = now + timedelta(seconds=breaker.cool_down_seconds)
        with self.watch("worker circuit"), unit_of_work():
            if gate.probe is not None:
                opened = circuits.reopen(source, name, gate.probe, now, retry_at)
            else:
                opened = circuits.fail(source, name, now, breaker.failures, retry_at)
            if opened:
                circuits.hold_pending(source, name, retry_at, now)
        if not opened:
            return
        self._remember((source, name), retry_at)
        fields = self._fields(source, name, circuit=circuits.OPEN, retry_at=retry_at.isoformat())
        if gate.probe is not None:
            log.info(
                "circuit of %s (%s) stays open: its probe failed; next probe at %s",
                name,
                source,
                retry_at.isoformat(),
                extra=fields,
            )
        else:
            log.warning(
                "circuit of %s (%s) opened after %d failures in a row; no delivery until %s",
                name,
                source,
                breaker.failures,
                retry_at.isoformat(),
                extra=fields,
            )

    def _hold(
        self, claim: Claim, source: str, now: datetime, until: datetime, why: str
    ) -> datetime:
        with self.watch("worker hold back"), unit_of_work():
            circuits.hold_back(claim, now, until)
        self._remember((source, claim.consumer), until)
        log.debug(
            "delivery %s to %s held back until %s: %s",
            claim.id,
            claim.consumer,
            until.isoformat(),
            why,
            extra=self._fields(source, claim.consumer, delivery_id=claim.id, reason=why),
        )
        return until

    def _remember(self, target: Target, until: datetime) -> None:
        with self._lock:
            self._held[target] = max(until, self._held.get(target, until))

    def _fields(self, source: str, consumer: str, **more: object) -> dict[str, object]:
        return {"source": source, "consumer": consumer, "worker": self.worker, **more}
