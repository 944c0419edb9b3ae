"""The worker: claim one delivery at a time, run it, record the outcome.

Handlers (the Inbox pattern): the claim commits; then one transaction locks
the claimed row by its lease token, runs the handler on the same session and
marks the delivery done. A failing handler's writes roll back with it and
the failure is recorded in a transaction of its own.

Forwards (two-phase): the claim commits; the HTTP call runs outside any
transaction; a fenced update then marks the delivery delivered (or retrying,
or dead). A worker killed during the call leaves the delivery in progress;
once its lease expires another worker claims it and calls again with the
same Idempotency-Key.

:meth:`Worker.run` runs ``WORKER_THREADS`` deliveries at once, one per
thread; the loop claims for a free thread, skipping the targets (a source's
consumer) that already have their ``concurrency`` (1 unless a forward says)
in flight here. A target that stalls holds its share of the threads, not
all of them: the others' deliveries get the rest.

SIGTERM and SIGINT let the current deliveries finish; then :meth:`Worker.run`
returns.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import signal
import socket
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from types import FrameType
from typing import Any

import requests
from flask import Flask
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError

from .. import tracing
from ..config import ConfigError
from ..database import (
    autocommit_connection,
    damage_message,
    driver_error_in,
    is_damaged,
    is_sqlite,
    is_unavailable,
    stall_watch,
    unit_of_work,
)
from ..extensions import db
from ..models import Event, utcnow
from ..outbox import attempts, circuits, deliveries, ordering
from ..outbox.deliveries import Claim
from . import attempts as attempt_log
from . import backoff, forwarding, limits, publishers, registry, replay
from .handlers import PermanentFailure
from .outcomes import DEAD, DELIVERED, LEASE_LOST, RETRY, SKIPPED, AttemptOutcome
from .registry import Consumer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Snapshot:
    source: Any
    dedup_key: Any
    event_type: str | None
    content_type: str | None
    body: bytes
    correlation_id: str | None
    # The traceparent the event was received under: its attempts continue that trace.
    traceparent: str | None = None
    # Its tracestate, kept beside it (a vendor's trace data): the attempts' trace state.
    tracestate: str | None = None
    # The target's circuit breaker, read with the event (limits.Gates).
    circuit: circuits.Circuit | None = None


# A claim's stand-in for an event not read (purged, or the read met an outage).
_UNREAD = _Snapshot(None, None, None, None, b"", None)


@dataclass(frozen=True)
class _Run:
    """One claimed delivery as ``process`` found it, for its handler or forward to run."""

    claim: Claim
    consumer: Consumer
    snap: _Snapshot
    # The event's place in its entity's order, when its source has an ordering rule.
    key: ordering.Key | None
    # The attempts the consumer may have (its own max_attempts, else the worker's).
    limit: int


class Worker:
    """One worker: a loop over claimable deliveries on the app's database."""

    def __init__(
        self,
        app: Flask,
        *,
        clock: Callable[[], datetime] = utcnow,
        rand: Callable[[], float] = random.random,
        http: requests.Session | None = None,
    ) -> None:
        config = app.config
        self.app = app
        self.registry = registry.get(app)
        self.clock = clock
        self.rand = rand
        self.lease = timedelta(seconds=float(config["WORKER_LEASE_SECONDS"]))
        self.poll_seconds = float(config["WORKER_POLL_SECONDS"])
        self.max_attempts = int(config["WORKER_MAX_ATTEMPTS"])
        self.backoff_base = float(config["WORKER_BACKOFF_BASE_SECONDS"])
        self.backoff_cap = float(config["WORKER_BACKOFF_MAX_SECONDS"])
        self.retry_after_cap = float(config["WORKER_RETRY_AFTER_MAX_SECONDS"])
        self.threads = int(config["WORKER_THREADS"])
        self.stall_after = float(config["DATABASE_STALL_WARNING_SECONDS"])
        # Off: no attempt rows, the delivery keeps its last error only.
        self.attempt_log = bool(config.get("WORKER_ATTEMPT_LOG", True))
        self._check_lease()
        # The caller's thread's session; the loop's threads open their own
        # (requests does not promise a Session is thread-safe), unless one
        # was handed in.
        self.http = http or requests.Session()
        self._shared_http = http is not None
        self._local = threading.local()
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        # Each forward target's circuit breaker and rate limit (limits.py).
        self.gates = limits.Gates(clock, self._watch, self.name)
        self._stop = threading.Event()
        self._slots: _Slots | None = None

    def _check_lease(self) -> None:
        for forward in self.registry.forwards():
            # A call ends within its timeout (each publisher bounds the
            # attempt as a whole); as much again is kept for the rest: the
            # claim, the event's read, the outcome's write. A rate limit's
            # wait never eats into it (limits._max_wait).
            if self.lease.total_seconds() <= 2 * forward.timeout_seconds:
                raise ConfigError(
                    f"WORKER_LEASE_SECONDS ({self.lease.total_seconds():g}) must exceed twice "
                    f"forward {forward.name!r}'s timeout_seconds ({forward.timeout_seconds:g}): "
                    "a lease that expires mid-call lets a second worker call too"
                )

    # -- the loop -----------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to return once the current deliveries are done."""
        self._stop.set()
        slots = self._slots
        if slots is not None:
            slots.wake()

    @property
    def stopping(self) -> bool:
        """Tell whether a stop was asked for."""
        return self._stop.is_set()

    def run(self, *, drain: bool = False, handle_signals: bool = True) -> int:
        """Process deliveries until stopped (or, with ``drain``, until none is due).

        Claims here, runs each claimed delivery on one of ``WORKER_THREADS``
        threads. Returns how many deliveries were attempted.
        """
        previous = self._install_signals() if handle_signals else {}
        slots = self._slots = _Slots(self, self.threads)
        replayer = replay.Runner(
            self.app, self._stop, max(self.poll_seconds, 1.0), clock=self.clock
        )
        pause = self.poll_seconds
        try:
            with self.app.app_context():
                log.info("worker %s started", self.name, extra={"worker": self.name})
                # Replays queued for a worker (the admin's bulk replays): in a
                # thread of their own, or all of them first when draining.
                if drain:
                    replayer.run_all()
                else:
                    replayer.start()
                slots.start()
                try:
                    while slots.wait_for_a_free_thread(self._stop):
                        # Idle as the claim looks: a delivery that finishes after
                        # it may leave a retry due, and draining must not miss it.
                        was_idle = slots.idle()
                        # A delivery that ends while the claim runs frees its
                        # target: the wait below must not sleep through that.
                        seen = slots.changes()
                        try:
                            claim = self._claim(slots.busy())
                            pause = self.poll_seconds
                        except Exception as exc:
                            db.session.rollback()
                            self._log_failure(exc)
                            self._stop.wait(pause)
                            pause = min(pause * 2, 30.0)
                            continue
                        if claim is not None:
                            slots.submit(claim)
                        elif drain and was_idle:
                            break
                        else:
                            # Nothing due, or only for busy targets: wait for
                            # a thread to finish, at most one poll.
                            slots.wait_for_a_change(seen, self.poll_seconds)
                finally:
                    slots.close()  # the deliveries in hand finish first
                    replayer.join()
                log.info("worker %s stopped", self.name, extra={"worker": self.name})
        finally:
            self._slots = None
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.http.close()
            publishers.close_thread_connections()
        return slots.done

    def _log_failure(self, exc: Exception) -> None:
        if is_damaged(exc):
            # Waited out as an outage, but no wait ends it: an operator must.
            log.error(
                "worker %s: %s",
                self.name,
                damage_message(exc),
                extra={"worker": self.name, "outage": "database"},
            )
        elif is_unavailable(exc):
            # The database is away, locked, read-only (a standby after a
            # failover) or too slow (the statement timeout): wait, then retry.
            log.warning(
                "worker %s: database unavailable, retrying: %s",
                self.name,
                getattr(exc, "orig", None) or exc,
                extra={"worker": self.name, "outage": "database"},
            )
        else:
            # A bug must not stop every worker in turn: the claimed delivery
            # stays in progress, is claimed again when its lease ends
            # (counting an attempt) and goes dead at the attempt limit.
            log.exception("worker %s: unexpected error", self.name)

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("worker %s: signal %s, finishing the current deliveries", self.name, signum)
            self.stop()

        return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def run_once(self) -> AttemptOutcome | None:
        """Claim and process one due delivery; None when none is due. Needs an app context."""
        claim = self._claim()
        if claim is None:
            return None
        return self.attempt(claim)

    def _claim(self, skip: Collection[tuple[str, str]] = ()) -> Claim | None:
        now = self.clock()
        # Nor the targets whose circuit or rate limit held a delivery back here.
        skip = [*skip, *self.gates.held(now)]
        with self._watch("worker claim"), unit_of_work():
            return deliveries.claim_next(now, self.lease, skip)

    def attempt(self, claim: Claim) -> AttemptOutcome:
        """Process a claimed delivery, then log and report its outcome. Needs an app context."""
        started = time.monotonic()
        self._local.notes = attempt_log.Notes.begin(self.clock())
        try:
            outcome = self.process(claim)
        except BaseException:
            db.session.rollback()
            raise
        finally:
            self._local.notes = None
        outcome = replace(outcome, duration_seconds=time.monotonic() - started)
        if outcome.outcome != limits.HELD:  # held back by a gate: no attempt to report
            self.report(outcome)
        return outcome

    def limit_of(self, source: str, consumer: str) -> int:
        """How many deliveries of this target this process may run at once."""
        found = self.registry.find(source, consumer)
        return found.concurrency if found is not None else 1

    def _watch(self, what: str) -> AbstractContextManager[None]:
        return stall_watch(what, self.stall_after, worker=self.name)

    def _session(self) -> requests.Session:
        return getattr(self._local, "http", None) or self.http

    def _open_thread(self) -> None:
        if not self._shared_http:
            self._local.http = requests.Session()

    def _close_thread(self) -> None:
        http = getattr(self._local, "http", None)
        if http is not None:
            http.close()
            self._local.http = None
        publishers.close_thread_connections()

    # -- one delivery ---------------------------------------------------------

    def process(self, claim: Claim) -> AttemptOutcome:
        """Run one claimed delivery to its next state."""
        try:
            event = self._read_event(claim)
        except Exception as exc:
            db.session.rollback()
            if not is_unavailable(exc):
                raise
            # Nothing ran yet: no attempt spent on the database's outage.
            return self._give_back(claim, _UNREAD, exc)
        if event is None:
            # Purged since the claim; its deliveries went with it.
            return self._outcome(claim, _UNREAD, LEASE_LOST, error="event deleted")
        columns = len(circuits.COLUMNS)
        snap = _Snapshot(*event[:-columns])
        snap = replace(snap, circuit=circuits.of_row(snap.source, claim.consumer, event[-columns:]))
        consumer = self.registry.find(snap.source, claim.consumer)
        limit = self.max_attempts
        if consumer is not None and consumer.max_attempts is not None:
            limit = consumer.max_attempts
        if consumer is None or consumer.kind != claim.kind:
            return self._give_up(
                claim, snap, f"consumer {claim.consumer!r} is no longer configured", None
            )
        if claim.attempt > limit:
            # The previous holder's lease expired on the last allowed attempt.
            return self._give_up(
                claim, snap, f"out of attempts ({limit}); the last one's lease expired", None
            )
        run = _Run(claim, consumer, snap, self._ordering_key(consumer, snap), limit)
        with tracing.span(
            "delivery attempt",
            parent=snap.traceparent,
            tracestate=snap.tracestate,
            consumer=consumer.name,
            event_id=claim.event_id,
            attempt=claim.attempt,
            dedup_key=snap.dedup_key,
            correlation_id=snap.correlation_id,
        ) as span:
            if consumer.handler is not None:
                outcome = self._run_handler(run)
            else:
                outcome = self._run_forward(run)
            if span is not None:
                span.set_attribute("outcome", outcome.outcome)
        return outcome

    def _read_event(self, claim: Claim) -> Any:
        """The claimed delivery's event and its target's circuit (None: purged since)."""
        with self._watch("worker event read"):
            event = db.session.execute(
                select(
                    Event.source,
                    Event.dedup_key,
                    Event.event_type,
                    Event.content_type,
                    Event.body,
                    Event.correlation_id,
                    Event.meta[tracing.META_KEY].as_string(),
                    Event.meta[tracing.TRACESTATE_META].as_string(),
                    *circuits.COLUMNS,
                )
                .select_from(circuits.joined(claim.consumer))
                .where(Event.id == claim.event_id)
            ).one_or_none()
            # End the read, so that the next transaction opens with its write.
            db.session.rollback()
        return event

    def _ordering_key(self, consumer: Consumer, snap: _Snapshot) -> ordering.Key | None:
        rule = self.registry.ordering.get(snap.source)
        if rule is None:
            return None
        return ordering.key_for(consumer.name, snap.body, rule.version, rule.entity)

    def _run_handler(self, run: _Run) -> AttemptOutcome:
        claim, consumer, snap, key = run.claim, run.consumer, run.snap, run.key
        assert consumer.handler is not None
        now = self.clock()
        in_handler = called = False
        try:
            # One transaction: the handler's writes and the done-marker commit together.
            with unit_of_work() as session:
                if not deliveries.hold(claim, now):
                    raise _LeaseLost()
                if key is not None and not ordering.advance(snap.source, key, claim.event_id, now):
                    deliveries.mark_skipped(claim, now, ordering.STALE)
                    return self._skipped_as_stale(claim, snap)
                event = session.get(Event, claim.event_id, populate_existing=True)
                in_handler = called = True
                consumer.handler.func(event, session)
                # Its pending writes are its own statements too.
                session.flush()
                in_handler = False
                if not deliveries.mark_delivered(claim, self.clock()):
                    raise _LeaseLost()
                self._log_attempt(claim, attempt_log.DELIVERED)
        except _LeaseLost:
            return self._outcome(claim, snap, LEASE_LOST)
        except Exception as exc:
            # The session ended for idling: the idle time was the handler's,
            # whichever statement (its own, or the done-marker) met the end.
            idled = called and _idle_timed_out(exc)
            if is_unavailable(exc) and not idled and not (in_handler and _timed_out(exc)):
                # The database failed, not the handler: no attempt spent.
                return self._give_back(claim, snap, exc)
            # The handler's own writes went with the rollback; the failure is
            # recorded on its own.
            permanent = isinstance(exc, PermanentFailure)
            error = f"{type(exc).__name__}: {exc}"
            if idled:
                error = (
                    "the handler kept its transaction idle past PostgreSQL's "
                    "idle_in_transaction_session_timeout and the server ended the "
                    f"session: {getattr(exc, 'orig', None) or exc}"
                )
            log.debug("handler %s failed", consumer.name, exc_info=True)
            return self._fail(claim, snap, error, None, None, run.limit, permanent=permanent)
        return self._outcome(claim, snap, DELIVERED)

    def _run_forward(self, run: _Run) -> AttemptOutcome:
        claim, consumer, snap, key = run.claim, run.consumer, run.snap, run.key
        assert consumer.forward is not None
        if key is not None:
            try:
                with self._watch("worker ordering check"), unit_of_work():
                    now = self.clock()
                    if ordering.skip_if_stale(claim, snap.source, key, now):
                        return self._skipped_as_stale(claim, snap)
                    if not ordering.take_entity(claim, snap.source, key, now):
                        return self._wait_for_entity(claim, snap, now)
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                # Nothing was sent: no attempt spent on the database's outage.
                return self._give_back(claim, snap, exc)
        out = forwarding.Outgoing(
            event_id=claim.event_id,
            source=snap.source,
            dedup_key=snap.dedup_key,
            event_type=snap.event_type,
            content_type=snap.content_type,
            body=snap.body,
            correlation_id=snap.correlation_id,
            traceparent=snap.traceparent,
            tracestate=snap.tracestate,
            key_replay=claim.key_replay,
        )
        try:
            gate = self.gates.enter(claim, snap.source, consumer.forward, snap.circuit)
        except Exception as exc:
            db.session.rollback()
            if not is_unavailable(exc):
                raise
            # Nothing was sent: no attempt spent on the database's outage.
            return self._give_back(claim, snap, exc)
        if not isinstance(gate, limits.Pass):
            return self._outcome(claim, snap, limits.HELD, next_attempt_at=gate)
        result = forwarding.send(self._session(), consumer.name, consumer.forward, out)
        self._leave(gate, consumer.forward, result)
        self._note_result(result)
        if not result.ok:
            return self._fail(
                claim,
                snap,
                result.error or "failed",
                result.status,
                result.retry_after,
                run.limit,
                permanent=not result.retryable,
            )
        now = self.clock()
        if key is None:
            marked = self._finish(
                claim,
                now,
                deliveries.delivered_values(now, result.status),
                attempt_log.DELIVERED,
                status=result.status,
            )
            return self._outcome(
                claim, snap, DELIVERED if marked else LEASE_LOST, status=result.status
            )

        def write() -> bool:
            with self._watch("worker outcome"), unit_of_work():
                self._log_attempt(claim, attempt_log.DELIVERED, status=result.status)
                if not deliveries.mark_delivered(claim, now, result.status):
                    return False
                # Already sent, so it is delivered either way; the version
                # only moves forward.
                ordering.advance(snap.source, key, claim.event_id, now)
            return True

        marked = self._through_outage(claim, write)
        return self._outcome(claim, snap, DELIVERED if marked else LEASE_LOST, status=result.status)

    def _give_back(self, claim: Claim, snap: _Snapshot, exc: Exception) -> AttemptOutcome:
        """Give a delivery the database kept from running back, unattempted, due shortly.

        Its event's read, a handler's transaction, or a forward's ordering
        check or gates before its call.
        """
        until = self.clock() + timedelta(seconds=max(self.poll_seconds, 1.0))
        log.warning(
            "worker %s: database unavailable while delivery %s ran; given back unattempted: %s",
            self.name,
            claim.id,
            getattr(exc, "orig", None) or exc,
            extra={"worker": self.name, "outage": "database", "delivery_id": claim.id},
        )

        def write() -> bool:
            with self._watch("worker hold back"), unit_of_work():
                return circuits.hold_back(claim, self.clock(), until)

        self._through_outage(claim, write)
        return self._outcome(claim, snap, limits.HELD, next_attempt_at=until)

    def _leave(self, gate: limits.Pass, forward: Any, result: forwarding.Result) -> None:
        """Record the answer on the target's circuit; an outage there keeps no outcome back.

        The call is made: its outcome must still be written (it waits out the
        outage within the lease). The circuit misses this one answer; a probe
        left half-open is taken over when its time ends.
        """
        try:
            self.gates.leave(gate, forward, failed=not result.ok and result.retryable)
        except Exception as exc:
            db.session.rollback()
            if not is_unavailable(exc):
                raise
            log.warning(
                "worker %s: database unavailable, the circuit of %s (%s) misses an answer: %s",
                self.name,
                gate.consumer,
                gate.source,
                getattr(exc, "orig", None) or exc,
                extra={"worker": self.name, "outage": "database"},
            )

    def _wait_for_entity(self, claim: Claim, snap: _Snapshot, now: datetime) -> AttemptOutcome:
        """Give the delivery back unattempted: another version of its entity is being sent.

        Looked at again after RECHECK_SECONDS: by then the other is mostly
        done, and this one is sent after it, or skipped if it is older.
        """
        until = now + timedelta(seconds=limits.RECHECK_SECONDS)
        circuits.hold_back(claim, now, until)
        log.debug(
            "worker %s: delivery %s waits for another version of its entity in flight",
            self.name,
            claim.id,
            extra={"worker": self.name, "delivery_id": claim.id},
        )
        return self._outcome(claim, snap, limits.HELD, next_attempt_at=until)

    def _skipped_as_stale(self, claim: Claim, snap: _Snapshot) -> AttemptOutcome:
        """Log the attempt skipped (a newer version is applied), in the marking unit of work."""
        self._log_attempt(claim, attempt_log.SKIPPED, error=ordering.STALE)
        return self._outcome(claim, snap, SKIPPED, error=ordering.STALE)

    def _fail(
        self,
        claim: Claim,
        snap: _Snapshot,
        error: str,
        status: int | None,
        retry_after: str | None,
        limit: int,
        *,
        permanent: bool,
    ) -> AttemptOutcome:
        if permanent or claim.attempt >= limit:
            if not permanent:
                error = f"out of attempts ({limit}): {error}"
            return self._give_up(claim, snap, error, status, retryable=not permanent)
        now = self.clock()
        delay = backoff.delay_seconds(
            claim.attempt,
            base=self.backoff_base,
            cap=self.backoff_cap,
            retry_after=backoff.parse_retry_after(retry_after, now),
            retry_after_cap=self.retry_after_cap,
            rand=self.rand,
        )
        next_at = now + timedelta(seconds=delay)
        marked = self._finish(
            claim,
            now,
            deliveries.retry_values(next_at, error, status),
            attempt_log.RETRYABLE_FAILURE,
            status=status,
            error=error,
        )
        if not marked:
            return self._outcome(claim, snap, LEASE_LOST, status=status, error=error)
        return self._outcome(
            claim, snap, RETRY, status=status, error=error, next_attempt_at=next_at
        )

    def _give_up(
        self,
        claim: Claim,
        snap: _Snapshot,
        error: str,
        status: int | None,
        *,
        retryable: bool = False,
    ) -> AttemptOutcome:
        failure = attempt_log.RETRYABLE_FAILURE if retryable else attempt_log.PERMANENT_FAILURE
        now = self.clock()
        marked = self._finish(
            claim,
            now,
            deliveries.dead_values(now, error, status),
            failure,
            status=status,
            error=error,
        )
        return self._outcome(
            claim, snap, DEAD if marked else LEASE_LOST, status=status, error=error
        )

    def _outcome(
        self, claim: Claim, snap: _Snapshot, outcome: str, **fields: Any
    ) -> AttemptOutcome:
        return AttemptOutcome(
            delivery_id=claim.id,
            event_id=claim.event_id,
            source=snap.source,
            consumer=claim.consumer,
            kind=claim.kind,
            dedup_key=snap.dedup_key,
            correlation_id=snap.correlation_id,
            attempt=claim.attempt,
            outcome=outcome,
            **fields,
        )

    def _note_result(self, result: forwarding.Result) -> None:
        notes = getattr(self._local, "notes", None)
        if notes is not None:
            notes.response_body = result.response_body
            notes.confirmation = result.confirmation

    def _finish(
        self,
        claim: Claim,
        now: datetime,
        values: dict[str, Any],
        outcome: str,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> bool:
        """Set the outcome's ``values``, with the attempt's row; False if the lease was lost.

        For an outcome that writes nothing else: on PostgreSQL, with the
        attempt log on, one statement outside any transaction (a
        data-modifying CTE, ``outbox.attempts.add_with_outcome``), its own
        unit of work in one round trip, durable when it returns; else the
        row and the outcome in one ``unit_of_work`` (SQLite's in the
        writers' turn). Either way the row is written even if the lease was
        lost, and nothing of the delivery changes then.
        """

        def write() -> bool:
            with self._watch("worker outcome"):
                if self.attempt_log and not is_sqlite():
                    attempt = self._attempt(claim, outcome, status=status, error=error)
                    with autocommit_connection() as connection:
                        return attempts.add_with_outcome(connection, attempt, claim, now, values)
                with unit_of_work():
                    self._log_attempt(claim, outcome, status=status, error=error)
                    return deliveries.finish(claim, now, values)

        return self._through_outage(claim, write)

    def _through_outage(self, claim: Claim, write: Callable[[], bool]) -> bool:
        """Run an outcome's ``write``, again while the database is away, within the claim's lease.

        The attempt is over: a write given up at once left the delivery in
        progress until its lease ended, to be sent again, and dead if that
        was its last attempt, for the worker's own database. Past the lease
        the error goes up (another worker may hold the delivery by then).
        """
        remaining = (claim.lease_expires_at - self.clock()).total_seconds()
        give_up = time.monotonic() + remaining
        pause = 0.25
        while True:
            try:
                return write()
            except Exception as exc:
                db.session.rollback()
                if not is_unavailable(exc) or time.monotonic() + pause >= give_up:
                    raise
                log.warning(
                    "worker %s: database unavailable, writing the outcome of delivery %s "
                    "again in %g s: %s",
                    self.name,
                    claim.id,
                    pause,
                    getattr(exc, "orig", None) or exc,
                    extra={"worker": self.name, "outage": "database", "delivery_id": claim.id},
                )
                time.sleep(pause)
                pause = min(pause * 2, 5.0)

    def _log_attempt(
        self, claim: Claim, outcome: str, *, status: int | None = None, error: str | None = None
    ) -> None:
        """Add the attempt's row, in the unit of work that records its outcome."""
        if self.attempt_log:
            attempts.add(self._attempt(claim, outcome, status=status, error=error))

    def _attempt(
        self, claim: Claim, outcome: str, *, status: int | None, error: str | None
    ) -> attempts.Attempt:
        """The attempt's row, ending now, with what this thread noted of its call."""
        notes = getattr(self._local, "notes", None)
        return attempt_log.of(
            claim, notes, self.clock(), outcome, status=status, error=error, worker=self.name
        )

    # -- observability --------------------------------------------------------

    def report(self, outcome: AttemptOutcome) -> None:
        """Log the attempt (one line) and hand it to every outcome hook."""
        level = logging.INFO if outcome.outcome in (DELIVERED, SKIPPED) else logging.WARNING
        log.log(
            level,
            "delivery %s to %s: %s (attempt %s)",
            outcome.delivery_id,
            outcome.consumer,
            outcome.outcome,
            outcome.attempt,
            extra={**outcome.log_fields(), "worker": self.name},
        )
        for hook in self.registry.outcome_hooks:
            try:
                hook(outcome)
            except Exception:
                log.exception("delivery outcome hook %r failed", hook)


class _LeaseLost(Exception):
    """The lease was taken over while the handler ran: its writes must not commit."""


class _Slots:
    """The worker's delivery threads, and how many deliveries each target has on them."""

    def __init__(self, worker: Worker, size: int) -> None:
        self.worker = worker
        self.size = size
        self.done = 0
        # Reentrant: Worker.stop wakes the loop from a signal handler, which
        # may interrupt the loop's thread while it holds the lock.
        self._changed = threading.Condition(threading.RLock())
        self._free = size
        # Counts each change (a delivery ended, a wake): what a wait compares.
        self._changes = 0
        self._in_flight: Counter[tuple[str, str]] = Counter()
        self._claims: queue.SimpleQueue[Claim | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"delivery-{n}", daemon=True)
            for n in range(size)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Let each thread finish its delivery, then end it."""
        for _ in self._threads:
            self._claims.put(None)
        for thread in self._threads:
            if thread.is_alive():
                thread.join()

    def wake(self) -> None:
        with self._changed:
            self._changes += 1
            self._changed.notify_all()

    def wait_for_a_free_thread(self, stop: threading.Event) -> bool:
        """Wait until a thread is free; False once ``stop`` is set."""
        with self._changed:
            while self._free == 0 and not stop.is_set():
                self._changed.wait(1.0)
            return not stop.is_set()

    def changes(self) -> int:
        """How many changes so far: given back to wait_for_a_change."""
        with self._changed:
            return self._changes

    def wait_for_a_change(self, since: int, timeout: float) -> None:
        """Wait at most ``timeout`` for a change after the ``since``-th (none if one came already).

        A notification before the wait began would be lost: a delivery that
        ended while the loop claimed left its target busy in the claim, and
        the loop slept a whole poll with the target free (a forward target
        of concurrency 1 got one delivery a poll).
        """
        with self._changed:
            if self._changes == since:
                self._changed.wait(timeout)

    def idle(self) -> bool:
        with self._changed:
            return self._free == self.size

    def busy(self) -> list[tuple[str, str]]:
        """The targets with as many deliveries in flight as they may have."""
        with self._changed:
            return [
                target
                for target, count in self._in_flight.items()
                if count >= self.worker.limit_of(*target)
            ]

    def submit(self, claim: Claim) -> None:
        with self._changed:
            self._in_flight[_target(claim)] += 1
            self._free -= 1
        self._claims.put(claim)

    def _serve(self) -> None:
        worker = self.worker
        with worker.app.app_context():
            worker._open_thread()
            try:
                while (claim := self._claims.get()) is not None:
                    try:
                        outcome = worker.attempt(claim)
                        with self._changed:
                            # Held back by a gate, it was not attempted.
                            self.done += outcome.outcome != limits.HELD
                    except Exception as exc:
                        worker._log_failure(exc)
                    finally:
                        self._release(claim)
            finally:
                worker._close_thread()
                db.session.remove()

    def _release(self, claim: Claim) -> None:
        with self._changed:
            target = _target(claim)
            self._in_flight[target] -= 1
            if self._in_flight[target] <= 0:
                del self._in_flight[target]
            self._free += 1
            self._changes += 1
            self._changed.notify_all()


def _timed_out(exc: Exception) -> bool:
    """Tell a statement that waited past its limit (a lock, its time) on a database still there.

    A handler's own such statement fails the same way each time: handed
    back uncounted it was retried for ever, never dead.
    """
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return False
    return driver_error_in(exc, sqlite_codes=_SQLITE_LOCK_WAITS, sqlstates=_PG_TIMEOUTS)


def _idle_timed_out(exc: Exception) -> bool:
    """Tell a session the server ended for idling in its transaction (its connection gone).

    Not the database away: the same handler idles as long each time, and
    handed back uncounted it was retried for ever.
    """
    return driver_error_in(exc, sqlite_codes=(), sqlstates=(_PG_IDLE_TIMEOUT,))


# idle_in_transaction_session_timeout: the server ends the session (FATAL).
_PG_IDLE_TIMEOUT = "25P03"
# query_canceled (the statement timeout), lock_not_available (the lock timeout).
_PG_TIMEOUTS = frozenset({"57014", "55P03"})
# Busy or locked past the busy timeout.
_SQLITE_LOCK_WAITS = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})


def _target(claim: Claim) -> tuple[str, str]:
    return (claim.source or "", claim.consumer)
