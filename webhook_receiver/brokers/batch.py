"""One batch of broker messages: identified, stored in one transaction, then a verdict each.

:func:`prepare` identifies the batch (CPU only, so a consumer prepares the
next batch while the database stores this one); :func:`store` stores it.
The consumers settle each message by its verdict only after
:func:`store` has returned, which is after the inbox's commit: a new
message and a same-content duplicate are acknowledged; a conflict (kept
for review by the inbox) and a message that cannot be identified are
dead-lettered. When the database is away or locked nothing is committed
and :class:`DatabaseUnavailable` is raised: nothing may be settled as done.

No message stops a consumer: whatever fails while one message is turned
into a BrokerMessage, identified or stored (but the database being away) makes
that message a dead letter with its reason, and the rest of its batch goes
on. A batch's redelivery counts are written in its own transaction (on
PostgreSQL its one statement), so none is acknowledged before its count
is written: a consumer killed outright loses no count.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar, cast

from flask import Flask
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from .. import inbox, rejections, tracing
from ..config import BrokerSourceConfig
from ..database import is_unavailable, stall_watch
from ..inbox import Accepted, Conflict, Duplicate, Message, Outcome
from ..observability import metrics
from .identify import CONSUMER_ERROR, BrokerMessage, Unidentified, content_fingerprint, identify
from .outage import Outage, SourceNotReady

log = logging.getLogger(__name__)

ACK = "ack"
DEAD_LETTER = "dead_letter"
CONFLICT = "conflict"
UNSTORABLE = "unstorable"


class DatabaseUnavailable(Exception):
    """The database is away or locked: the batch was not committed."""


class Verdict(NamedTuple):
    """How to settle one message of a batch: ack, or dead-letter with a reason.

    A NamedTuple: immutable, so every acknowledged message shares one.
    """

    action: str  # ACK | DEAD_LETTER
    reason: str | None = None
    detail: str | None = None
    # A dead letter's, for its log line: when read (and fit for a line).
    dedup_key: str | None = None
    correlation_id: str | None = None


ACKNOWLEDGED = Verdict(ACK)
_CONFLICTED = Verdict(DEAD_LETTER, CONFLICT, "dedup key reused with different content")
# What the inbox's outcome of a stored message makes of it.
_VERDICTS: dict[type, Verdict] = {
    Accepted: ACKNOWLEDGED,
    Duplicate: ACKNOWLEDGED,
    Conflict: _CONFLICTED,
}


class Prepared(NamedTuple):
    """A batch identified and ready to store; nothing of it is in the database yet."""

    # The messages to store, in the batch's order.
    messages: list[Message]
    # Per message received: None for the next of ``messages``, or the verdict of
    # one that cannot be stored (dead-lettered with its reason).
    verdicts: list[Verdict | None]
    # ``messages`` staged for the inbox (inbox.stage), when built ahead.
    staged: inbox.Staged | None = None


Raw = TypeVar("Raw")


def prepare(
    source: BrokerSourceConfig, raws: Sequence[Raw], to_message: Callable[[Raw], BrokerMessage]
) -> Prepared:
    """Turn each raw message of a batch into a BrokerMessage and identify it: CPU only, no database.

    A consumer prepares a batch while the one before it is being stored,
    so that the two overlap. A message that cannot be read or identified,
    for whatever reason, gets its dead-letter verdict here; the others go on.
    """
    verdicts: list[Verdict | None] = []
    messages: list[Message] = []
    for raw in raws:
        try:
            messages.append(identify(source, to_message(raw)))
            verdicts.append(None)
        except Unidentified as exc:
            verdicts.append(
                Verdict(DEAD_LETTER, exc.reason, exc.detail, exc.dedup_key, exc.correlation_id)
            )
        except Exception as exc:  # a bug, but one message's: never the consumer's end
            log.exception("source %s: a message could not be identified", source.name)
            verdicts.append(Verdict(DEAD_LETTER, CONSUMER_ERROR, _name(exc)))
    return Prepared(messages, verdicts)


def store(
    source: BrokerSourceConfig,
    prepared: Prepared,
    *,
    positions: Sequence[inbox.Position] = (),
) -> list[Verdict]:
    """Store a prepared batch in one transaction; a verdict per message (needs an app context).

    Raises DatabaseUnavailable, with nothing committed, when the database
    is away or locked. ``positions`` (a partitioned log's consumer: where
    the source reads on from) are written in the batch's transaction; when
    its messages are stored one at a time, after the last one, in a
    transaction of their own (whether the last one was stored or
    dead-lettered), once.
    """
    messages, verdicts = prepared.messages, prepared.verdicts
    compare = content_fingerprint(source)
    outcomes: Sequence[Outcome | Verdict]
    try:
        # A stalled database is said once, past a few seconds; the statement
        # timeout then ends the wait as an outage.
        with (
            stall_watch("broker batch store", source=source.name),
            tracing.span("broker batch", source=source.name, messages=len(messages)),
        ):
            outcomes = inbox.receive_many(
                messages,
                content_fingerprint=compare,
                positions=positions,
                counts_in_transaction=True,
                staged=prepared.staged,
            )
    except Exception as exc:
        raise_if_unavailable(exc)
        # One message the database (or a bug) refuses must not hold back the
        # batch on every redelivery: store them one by one to find it.
        log.warning(
            "source %s: a batch failed to store (%s); storing one by one",
            source.name,
            _name(exc),
            exc_info=not isinstance(exc, DBAPIError),
        )
        outcomes = [_one(message, compare) for message in messages]
        if positions:
            try:
                inbox.receive_many([], positions=positions)
            except Exception as exc:
                raise_if_unavailable(exc)
                raise
    _count(source.name, outcomes)
    if len(outcomes) == len(verdicts):  # every message was stored: the usual batch
        return [_verdict(outcome) for outcome in outcomes]
    stored = iter(outcomes)
    return [v if v is not None else _verdict(next(stored)) for v in verdicts]


def _one(message: Message, compare: inbox.ContentFingerprint) -> Outcome | Verdict:
    try:
        stored = inbox.receive_many(
            [message], content_fingerprint=compare, counts_in_transaction=True
        )
        return stored[0]
    except Exception as exc:
        raise_if_unavailable(exc)
        if isinstance(exc, DBAPIError):
            return Verdict(
                DEAD_LETTER,
                UNSTORABLE,
                type(exc.orig or exc).__name__,
                message.dedup_key,
                message.correlation_id,
            )
        log.exception("source %s: a message could not be stored", message.source)
        return Verdict(
            DEAD_LETTER, CONSUMER_ERROR, _name(exc), message.dedup_key, message.correlation_id
        )


def _named(verdict: Verdict) -> dict[str, str]:
    """The dedup key and correlation id a dead letter's log line names, those it has."""
    named = {"dedup_key": verdict.dedup_key, "correlation_id": verdict.correlation_id}
    return {name: value for name, value in named.items() if value is not None}


def raise_if_unavailable(exc: Exception) -> None:
    """Raise DatabaseUnavailable from ``exc`` when it says the database is away or locked."""
    if isinstance(exc, DBAPIError | PoolTimeoutError) and is_unavailable(exc):
        # A driver error says more than SQLAlchemy's wrapper; a pool timeout has none.
        raise DatabaseUnavailable(str(getattr(exc, "orig", None) or exc)) from exc


def _name(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]


def _verdict(outcome: Outcome | Verdict) -> Verdict:
    # A Verdict already: a message refused when stored on its own (_one).
    return _VERDICTS.get(type(outcome)) or cast(Verdict, outcome)


def _count(source: str, outcomes: Sequence[Outcome | Verdict]) -> None:
    # What the commit decided, counted per batch: one increment per counter
    # rather than one per message. Dead letters count once settled (see
    # Consumer.dead_lettered).
    kinds = Counter(map(type, outcomes))
    metrics.received(source, kinds[Accepted])
    metrics.duplicate(source, kinds[Duplicate])
    metrics.conflict(source, kinds[Conflict])


class Consumer:
    """What every broker consumer holds: its app, source, stop signal, outage log, unit of work.

    An adapter subclasses it: ``session`` connects and then fetches, stores
    (``prepare`` and ``store``) and settles batches until stopped or its
    broker goes; ``run`` is the loop every adapter shares around it.
    """

    # The client's errors that mean the broker is away: the session ends, the
    # outage is logged once and backed off, and a new session starts.
    broker_errors: tuple[type[BaseException], ...] = (OSError,)
    # What the source names, for the log of its absence ("queue", "stream"...).
    source_noun = "queue"
    # A dead-letter copy past the broker's limits, in the adapter's words:
    # its lines keep the adapter's logger; the field the copy carries its
    # reason in ("dead-letter-reason attribute"), and what befalls a message
    # whose copy is refused for good ("the message is deleted").
    logger = log
    reason_field: str
    settled_without_copy: str

    def __init__(self, app: Flask, source: BrokerSourceConfig, stop: threading.Event) -> None:
        self.app = app
        self.source = source
        self.stop = stop
        # Each cause of outage on its own: the end of one never times another.
        self.broker = Outage(source.name, "broker")
        self.database = Outage(source.name, "database")
        self.not_ready = Outage(source.name, self.source_noun)
        # The unit of work, in two steps; the benchmark's bare loop puts
        # steps that identify and store nothing.
        self.prepare: Callable[
            [BrokerSourceConfig, Sequence[Any], Callable[[Any], BrokerMessage]], Prepared
        ] = prepare
        self.store: Callable[[BrokerSourceConfig, Prepared], list[Verdict]] = store
        # Messages settled so far (acked or dead-lettered), for the benchmark and tests.
        self.settled = 0

    def run(self) -> None:
        """Consume until stopped: a session at a time, backing off through outages.

        A source the broker does not have yet (``SourceNotReady``) is waited
        for; a broker error ends the session and starts another after the
        back-off. Anything else is a bug: the runner restarts the consumer.
        """
        while not self.stop.is_set():
            try:
                self.session()
            except SourceNotReady as exc:
                self.stop.wait(self.not_ready.failed(exc))
            except self.broker_errors as exc:
                self.stop.wait(self.broker.failed(self.describe(exc)))

    def session(self) -> None:
        """Connect, then fetch, store and settle batches until stopped (each adapter's own)."""
        raise NotImplementedError

    def prepare_batch(
        self, raws: Sequence[Any], to_message: Callable[[Any], BrokerMessage]
    ) -> Prepared:
        """Identify a batch (``prepare``) and stage its rows for the inbox: CPU only.

        What a reading thread does while the batch before is stored: the
        storing thread is then left only the statement to send and wait on.
        """
        prepared = self.prepare(self.source, raws, to_message)
        if not prepared.messages:
            return prepared
        with self.app.app_context():
            try:
                staged = inbox.stage(prepared.messages)
            except Exception:
                # Stored as it is: the storing thread builds the rows again,
                # where a message they refuse is found and dead-lettered alone.
                return prepared
        return prepared._replace(staged=staged)

    def store_prepared(self, prepared: Prepared) -> list[Verdict]:
        """Store a prepared batch in the app's context: what a storing thread runs."""
        with self.app.app_context():
            return self.store(self.source, prepared)

    def describe(self, exc: BaseException) -> str:
        """An outage's error as its log line says it (with no credentials)."""
        return f"{type(exc).__name__}: {exc}"

    def copy_without_reason(
        self,
        verdict: Verdict,
        why: object,
        copy: str = "",
        *,
        refused: bool = False,
        field: str | None = None,
    ) -> None:
        """Log (WARNING) a dead-letter copy that goes without its ``reason_field``, and why.

        ``copy`` names the copy after its words ("the dead-letter copy of
        message 7"); ``refused``: the broker refused it with the field first;
        ``field``: the fields it goes without, when not ``reason_field`` alone
        (the message's own of those names, kept).
        """
        went = (
            "was refused with its %s (%s), and sent without it"
            if refused
            else "went without its %s (%s)"
        )
        self.logger.warning(
            "source %s: the dead-letter copy%s " + went + "; its reason: %s",
            self.source.name,
            copy,
            field or self.reason_field,
            why,
            verdict.reason or "unknown",
            extra={"source": self.source.name, "reason": verdict.reason},
        )

    def copy_kept_own(
        self, verdict: Verdict, kept: Sequence[str], noun: str, why: object, copy: str = ""
    ) -> None:
        """Log (WARNING) a copy that went without fields of ours: ``kept``, the message's own.

        ``noun`` names what they are ("header", "field"), for the line's
        "A and B headers".
        """
        names = ", ".join(kept[:-1]) + " and " + kept[-1] if len(kept) > 1 else kept[0]
        plural = "s" if len(kept) > 1 else ""
        self.copy_without_reason(verdict, why, copy, field=f"{names} {noun}{plural}")

    def copy_refused(self, verdict: Verdict, why: object, copy: str = "") -> None:
        """Log (ERROR) a dead-letter copy refused for good: its message is settled without one.

        Said loudly, rather than the message given back and refused again
        for ever; it is still counted and listed as a dead letter
        (``dead_lettered``).
        """
        self.logger.error(
            "source %s: the dead-letter copy%s was refused (%s); %s without one",
            self.source.name,
            copy,
            why,
            self.settled_without_copy,
            extra={"source": self.source.name, "reason": verdict.reason},
        )

    def dead_lettered(self, verdicts: Sequence[Verdict]) -> None:
        """Count and log messages now dead-lettered (after the nack, or the copy's publish).

        Not when decided: a copy that could not be published leaves its
        message to come back, and it would be counted again.
        """
        if not verdicts:
            return
        source = self.source.name
        with self.app.app_context():
            for verdict in verdicts:
                reason = verdict.reason or "unknown"
                metrics.broker_dead_letter(source, reason)
                if verdict.reason != CONFLICT:  # the inbox kept and logged the conflict already
                    # Listed beside the webhooks' refusals for operators to see.
                    rejections.record(source, reason, verdict.detail or reason, None)
                    log.warning(
                        "source %s: message dead-lettered: %s: %s",
                        source,
                        verdict.reason,
                        verdict.detail,
                        extra={
                            "source": source,
                            "outcome": "dead_letter",
                            "reason": verdict.reason,
                            **_named(verdict),
                        },
                    )
