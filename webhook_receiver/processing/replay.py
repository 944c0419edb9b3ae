"""Replays: send stored events again, one event's deliveries or many chosen by a filter.

:func:`preview` counts what a filter takes (at most ``limit``) and notes the
highest matching delivery id, so that the replay that follows the
operator's confirmation takes the deliveries counted, not those made since.
:func:`run` records the replay and runs it in this process (the CLI, one
event's replay); :func:`queue` records it for a worker, whose
:class:`Runner` thread runs it in the background (the admin's bulk
replays, which would outlast a request). Either way :func:`resume` moves
the deliveries back in the queue (``outbox.replays.requeue``) in batches:
a read of the next batch's ids, then one short transaction per batch, so a
replay of 100,000 deliveries never holds a long transaction, and a rest
after each batch (``rest`` times as long as the batch took) leaves the
database to the intake. The process running it holds it under a lease that
each batch, and a long rest every third of the lease, renews: one that
died is resumed by a worker after its last batch. The worker then sends
the deliveries as any other pending ones, with the same Idempotency-Key,
or ``:replay-<n>`` after it when a new key was asked for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from flask import Flask

from ..database import end_read, is_unavailable, unit_of_work
from ..events import get_event
from ..extensions import db
from ..models import utcnow
from ..outbox import replays
from ..outbox.replays import Filter

log = logging.getLogger(__name__)

BATCH_SIZE = 500
# After each batch, wait this many times as long as it took (see resume).
REST = 9.0
# A replay's process holds it this long past its last batch; then a worker resumes it.
LEASE = timedelta(seconds=60)
SAME_KEY_WARNING = (
    "the Idempotency-Key (message id) is kept: a downstream that deduplicates on it "
    "will drop the replay; ask for a new key to have it taken as new"
)


class ReplayError(Exception):
    """A replay that cannot run as asked: no such event, or no delivery to replay."""


class Interrupted(Exception):
    """A recorded replay this process could not run to its end: the database went away.

    It is not lost: its record keeps where it got to, and a worker resumes
    it from there once this process's lease has ended. Running the command
    again would record a second replay of the same deliveries.
    """

    def __init__(self, replay_id: int, cause: BaseException) -> None:
        detail = str(getattr(cause, "orig", None) or cause).strip().splitlines()
        super().__init__(
            f"replay {replay_id} stopped part-way: the database cannot be reached"
            f" ({detail[0] if detail else type(cause).__name__}). It is recorded with what"
            f" it has done: a running `flask worker` resumes it where it stopped once its"
            f" lease ends ({LEASE.total_seconds():g} s). Do not run the command again: that"
            " would queue its deliveries a second time."
        )
        self.replay_id = replay_id


@dataclass(frozen=True)
class Preview:
    """What a replay would take: the count shown before the confirmation."""

    filter: Filter
    count: int
    # The highest delivery id counted: the replay stops there.
    up_to: int | None
    limit: int | None = None


@dataclass(frozen=True)
class Done:
    """What a replay did."""

    replay_id: int
    matched: int
    replayed: int
    consumers: Counter[str] = field(default_factory=Counter)

    @property
    def left_alone(self) -> int:
        """Counted before, not replayed: in progress at a worker, or gone since."""
        return max(0, self.matched - self.replayed)


def preview(flt: Filter, *, limit: int | None = None) -> Preview:
    """Count the deliveries ``flt`` takes (at most ``limit``), and where a replay of them ends."""
    if limit is not None and limit < 1:
        raise ValueError("limit must be at least 1")
    try:
        up_to = replays.highest_id(flt, limit=limit)
        count = 0 if up_to is None else replays.count(flt, limit=limit, up_to=up_to)
    finally:
        db.session.rollback()  # end the read: the replay's batches write
    return Preview(flt, count, up_to, limit)


def start(
    plan: Preview,
    *,
    actor: str,
    via: str,
    new_key: bool = False,
    rest: float = REST,
    clock: Callable[[], datetime] = utcnow,
    hold: bool = True,
) -> replays.Held:
    """Record the replay; with ``hold`` this process runs it now, else a worker will."""
    if rest < 0:
        raise ValueError("rest must not be negative")
    with unit_of_work():
        return replays.create(
            actor=actor,
            via=via,
            flt=plan.filter,
            new_key=new_key,
            matched=plan.count,
            up_to=plan.up_to,
            limit=plan.limit,
            rest=rest,
            now=clock(),
            lease=LEASE if hold else None,
        )


@dataclass(frozen=True)
class Progress:
    """What one process did of a replay: the deliveries it queued again, by consumer."""

    consumers: Counter[str]
    # False when it stopped before the end (asked to, or its lease was lost).
    finished: bool


class _LeaseLost(Exception):
    """Another process took the replay over: this batch must not commit."""


def resume(
    held: replays.Held,
    *,
    clock: Callable[[], datetime] = utcnow,
    batch_size: int = BATCH_SIZE,
    stop: threading.Event | None = None,
) -> Progress:
    """Run a held replay from where it got to, a batch per transaction, to its end.

    After each batch it waits ``held.rest`` times as long as the batch took,
    so that the intake keeps the database most of the time. ``stop`` ends it
    after a batch, letting another process resume it.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    consumers: Counter[str] = Counter()
    after, walked = held.after_id, held.walked
    while held.up_to is not None:
        if stop is not None and stop.is_set():
            with unit_of_work():
                replays.release(held)
            return Progress(consumers, finished=False)
        size = batch_size if held.max_count is None else min(batch_size, held.max_count - walked)
        if size <= 0:
            break
        started = time.monotonic()
        ids = replays.next_ids(held.filter, after=after, up_to=held.up_to, size=size)
        end_read()
        if not ids:
            break
        try:
            with unit_of_work():
                now = clock()
                moved = replays.requeue(
                    ids, now, held.id, new_key=held.new_key, state=held.filter.state
                )
                if not replays.advance(
                    held,
                    after_id=ids[-1],
                    walked=len(ids),
                    replayed=len(moved),
                    lease_until=now + LEASE,
                ):
                    raise _LeaseLost()
        except _LeaseLost:
            log.warning("replay %s: taken over by another process, stopping", held.id)
            return Progress(consumers, finished=False)
        consumers.update(row.consumer for row in moved)
        walked += len(ids)
        after = ids[-1]
        if len(ids) < size:
            break
        if held.rest and not _rest(held, held.rest * (time.monotonic() - started), clock, stop):
            log.warning("replay %s: taken over by another process, stopping", held.id)
            return Progress(consumers, finished=False)
    with unit_of_work():
        finished = replays.finish(held, clock())
    return Progress(consumers, finished)


def _rest(
    held: replays.Held,
    pause: float,
    clock: Callable[[], datetime],
    stop: threading.Event | None,
) -> bool:
    """Wait ``pause`` seconds (less if ``stop`` is set), holding the replay; False if lost.

    A rest longer than the lease let a worker take a running replay over as
    if its process had died: the lease is renewed every third of it.
    """
    end = time.monotonic() + pause
    step = LEASE.total_seconds() / 3
    while (left := end - time.monotonic()) > 0:
        if stop is not None:
            if stop.wait(min(left, step)):
                return True  # the loop stops and lets the replay go
        else:
            time.sleep(min(left, step))
        if end - time.monotonic() <= 0:
            return True  # the next batch renews it
        try:
            with unit_of_work():
                if not replays.renew(held, clock() + LEASE):
                    return False
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            # The next batch waits for the database too, and is fenced.
            log.warning("replay %s: database unavailable, lease not renewed: %s", held.id, exc)
    return True


def run(
    plan: Preview,
    *,
    actor: str,
    via: str,
    new_key: bool = False,
    rest: float = REST,
    clock: Callable[[], datetime] = utcnow,
    batch_size: int = BATCH_SIZE,
) -> Done:
    """Record the replay and run it here, to its end (the CLI, one event's replay).

    Raises Interrupted when the database goes away once it is recorded.
    """
    held = start(plan, actor=actor, via=via, new_key=new_key, rest=rest, clock=clock)
    try:
        progress = resume(held, clock=clock, batch_size=batch_size)
    except Exception as exc:
        if not is_unavailable(exc):
            raise
        raise Interrupted(held.id, exc) from exc
    done = Done(held.id, plan.count, sum(progress.consumers.values()), progress.consumers)
    _log_done(done, actor, via, plan, new_key)
    return done


def queue(
    plan: Preview,
    *,
    actor: str,
    via: str,
    new_key: bool = False,
    rest: float = REST,
    clock: Callable[[], datetime] = utcnow,
) -> int:
    """Record the replay for a worker to run in the background (the admin); its id."""
    held = start(plan, actor=actor, via=via, new_key=new_key, rest=rest, clock=clock, hold=False)
    log.info(
        "replay %s by %s: %d deliveries to queue again, by a worker",
        held.id,
        actor,
        plan.count,
        extra=_log_fields(held.id, actor, via, plan, new_key),
    )
    return held.id


def _log_done(done: Done, actor: str, via: str, plan: Preview, new_key: bool) -> None:
    log.info(
        "replay %s by %s: %d of %d deliveries queued again",
        done.replay_id,
        actor,
        done.replayed,
        done.matched,
        extra={
            **_log_fields(done.replay_id, actor, via, plan, new_key),
            "replayed": done.replayed,
            "consumers": dict(done.consumers),
        },
    )


def _log_fields(
    replay_id: int, actor: str, via: str, plan: Preview, new_key: bool
) -> dict[str, Any]:
    """A replay's log fields: who asked, through what, for what, and how many it matched."""
    return {
        "replay_id": replay_id,
        "actor": actor,
        "via": via,
        "filters": plan.filter.to_json(),
        "limit": plan.limit,
        "new_key": new_key,
        "matched": plan.count,
    }


class Runner:
    """Runs the replays queued for a worker (and any whose process died), one at a time.

    In a thread of the worker process of its own (``start``), or in the
    caller's thread until none is left (``run_all``, for ``worker --drain``).
    """

    def __init__(
        self,
        app: Flask,
        stop: threading.Event,
        poll_seconds: float,
        *,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.app = app
        self.stop = stop
        self.poll_seconds = poll_seconds
        self.clock = clock
        self._thread: threading.Thread | None = None

    def run_once(self) -> bool:
        """Claim one replay and run it to its end (or a stop); False if none was waiting."""
        try:
            # A read first: most polls find nothing, and ask for no write lock.
            found = replays.waiting(self.clock())
        finally:
            db.session.rollback()
        if not found:
            return False
        with unit_of_work():
            held = replays.claim(self.clock(), LEASE)
        if held is None:
            return False
        progress = resume(held, clock=self.clock, stop=self.stop)
        log.info(
            "replay %s: %d deliveries queued again by this worker%s",
            held.id,
            sum(progress.consumers.values()),
            "" if progress.finished else " (stopped before its end)",
            extra={"replay_id": held.id, "consumers": dict(progress.consumers)},
        )
        return True

    def run_all(self) -> None:
        """Run every waiting replay here, one after the other. Needs an app context."""
        while not self.stop.is_set() and self.run_once():
            pass

    def start(self) -> None:
        """Run waiting replays in a thread until ``stop`` is set."""
        self._thread = threading.Thread(target=self._loop, name="replays", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the thread to end (after ``stop``): its batch in hand commits first."""
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        with self.app.app_context():
            try:
                while not self.stop.is_set():
                    try:
                        ran = self.run_once()
                    except Exception as exc:
                        db.session.rollback()
                        ran = False
                        if is_unavailable(exc):
                            log.warning("replays: database unavailable, retrying: %s", exc)
                        else:
                            log.exception("replays: unexpected error")
                    if not ran:
                        self.stop.wait(self.poll_seconds)
            finally:
                db.session.remove()


def replay_event(
    event_id: int,
    consumer: str = "",
    *,
    actor: str,
    via: str,
    new_key: bool = False,
    clock: Callable[[], datetime] = utcnow,
) -> Done:
    """Send one event again to one of its consumers, or to all of them, whatever their state."""
    try:
        found = get_event(event_id) is not None
    finally:
        db.session.rollback()
    if not found:
        raise ReplayError(f"no event {event_id}")
    plan = preview(Filter(event_id=event_id, consumer=consumer))
    if plan.count == 0:
        if consumer:
            raise ReplayError(f"event {event_id} has no delivery to consumer {consumer!r}")
        raise ReplayError(f"event {event_id} has no deliveries (no consumer took it)")
    return run(plan, actor=actor, via=via, new_key=new_key, clock=clock)
