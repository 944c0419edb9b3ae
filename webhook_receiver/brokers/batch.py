"""One batch of broker messages: identified, stored in one transaction, then a verdict each.

The consumers settle each message by its verdict only after
:func:`store` has returned, which is after the inbox's commit: a new
message and a same-content duplicate are acknowledged; a conflict (kept
for review by the inbox) and a message that cannot be identified are
dead-lettered. When the database is away or locked nothing is committed
and :class:`DatabaseUnavailable` is raised: nothing may be settled as done.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

from flask import Flask
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from .. import inbox
from ..config import BrokerSourceConfig
from ..inbox import Accepted, Conflict, Duplicate, Message, Outcome
from ..observability import metrics
from .identify import Delivery, Unidentified, identify
from .outage import Outage

log = logging.getLogger(__name__)

ACK = "ack"
DEAD_LETTER = "dead_letter"
CONFLICT = "conflict"
UNSTORABLE = "unstorable"


class DatabaseUnavailable(Exception):
    """The database is away or locked: the batch was not committed."""


class Verdict(NamedTuple):
    """How to settle one message of a batch: ack, or dead-letter with a reason.

    A NamedTuple, one per message: immutable and cheap to build.
    """

    action: str  # ACK | DEAD_LETTER
    reason: str | None = None
    detail: str | None = None
    outcome: Outcome | None = None


def is_transient(exc: BaseException) -> bool:
    """Tell whether a database error is an outage (retry later) rather than this data's fault."""
    if isinstance(exc, OperationalError | InterfaceError | PoolTimeoutError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def store(source: BrokerSourceConfig, deliveries: Sequence[Delivery]) -> list[Verdict]:
    """Store a batch in one transaction and return a verdict per message (needs an app context).

    Raises DatabaseUnavailable, with nothing committed, when the database
    is away or locked.
    """
    verdicts: list[Verdict | None] = []
    messages: list[Message] = []
    for delivery in deliveries:
        try:
            messages.append(identify(source, delivery))
            verdicts.append(None)
        except Unidentified as exc:
            verdicts.append(Verdict(DEAD_LETTER, exc.reason, exc.detail))
    outcomes: Sequence[Outcome | Verdict]
    try:
        outcomes = inbox.receive_many(messages)
    except DBAPIError as exc:
        if is_transient(exc):
            raise DatabaseUnavailable(str(exc.orig or exc)) from exc
        # One message the database refuses must not hold back the batch on
        # every redelivery: store them one by one to find it.
        log.warning("source %s: a batch failed to store (%s); storing one by one", source.name, exc)
        outcomes = [_one(message) for message in messages]
    stored = iter(outcomes)
    result = [v if v is not None else _verdict(next(stored)) for v in verdicts]
    _count(source.name, result)
    return result


def _one(message: Message) -> Outcome | Verdict:
    try:
        return inbox.receive_many([message])[0]
    except DBAPIError as exc:
        if is_transient(exc):
            raise DatabaseUnavailable(str(exc.orig or exc)) from exc
        return Verdict(DEAD_LETTER, UNSTORABLE, f"{type(exc.orig or exc).__name__}")


def _verdict(outcome: Outcome | Verdict) -> Verdict:
    if isinstance(outcome, Verdict):
        return outcome
    if isinstance(outcome, Conflict):
        return Verdict(DEAD_LETTER, CONFLICT, "dedup key reused with different content", outcome)
    return Verdict(ACK, outcome=outcome)


def _count(source: str, verdicts: list[Verdict]) -> None:
    # Counted per batch: one increment per counter rather than one per message.
    kinds = Counter(type(v.outcome) for v in verdicts)
    metrics.received(source, kinds[Accepted])
    metrics.duplicate(source, kinds[Duplicate])
    metrics.conflict(source, kinds[Conflict])
    for verdict in verdicts:
        if verdict.action == DEAD_LETTER:
            metrics.broker_dead_letter(source, verdict.reason or "unknown")
            if verdict.reason != CONFLICT:  # the inbox logged the conflict already
                log.warning(
                    "source %s: message dead-lettered: %s: %s",
                    source,
                    verdict.reason,
                    verdict.detail,
                    extra={"source": source, "outcome": "dead_letter", "reason": verdict.reason},
                )


class Consumer:
    """What every broker consumer holds: its app, source, stop signal, outage log and store."""

    def __init__(self, app: Flask, source: BrokerSourceConfig, stop: threading.Event) -> None:
        self.app = app
        self.source = source
        self.stop = stop
        self.outage = Outage(source.name)
        # The unit of work; the benchmark's bare loop puts one that stores nothing.
        self.store: Callable[[BrokerSourceConfig, list[Delivery]], list[Verdict]] = store
        # Messages settled so far (acked or dead-lettered), for the benchmark and tests.
        self.settled = 0
