"""The log lines of the inbox's outcomes: one per message, or per source and batch."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .messages import Accepted, Conflict, Duplicate, Message, Outcome

# The name these lines had before the inbox was split by entry point (they
# came from inbox/store.py): operators' log filters and alerts match it.
log = logging.getLogger("webhook_receiver.inbox.store")


def log_outcome(message: Message, outcome: Outcome) -> None:
    """Log a message's outcome: a conflict at ERROR, the others at INFO."""
    if isinstance(outcome, Conflict):
        log.error(
            "dedup key reused with different content",
            extra={
                "outcome": "conflict",
                "source": message.source,
                "dedup_key": message.dedup_key,
                "event_id": outcome.event_id,
                "correlation_id": message.correlation_id,
            },
        )
    else:
        log_delivery(OUTCOME_NAMES[type(outcome)], message, outcome.event_id)


# Messages named by one batch line: a line stays a few kilobytes, under the
# line limits of log collectors (Docker's json-file driver splits at 16 KiB).
LOGGED_PER_LINE = 50


def log_batch(messages: Sequence[Message], outcomes: Sequence[Outcome]) -> None:
    """A line per source and up to LOGGED_PER_LINE messages of a batch, each with its outcome.

    A consumer stores thousands of messages a second: a line each cost
    about a quarter of its Python per message. Each message is still named in a line, with
    its dedup key, event id, outcome and correlation id, so a search for a
    key finds it; conflicts have an ERROR line each as well.
    """
    by_source: dict[str, list[dict[str, Any]]] = {}
    for message, outcome in zip(messages, outcomes, strict=True):
        entry = {
            "dedup_key": message.dedup_key,
            "event_id": outcome.event_id,
            "outcome": OUTCOME_NAMES[type(outcome)],
        }
        if message.correlation_id is not None:
            entry["correlation_id"] = message.correlation_id
        by_source.setdefault(message.source, []).append(entry)
    for source, entries in by_source.items():
        for start in range(0, len(entries), LOGGED_PER_LINE):
            chunk = entries[start : start + LOGGED_PER_LINE]
            named = [entry["outcome"] for entry in chunk]
            log.info(
                "batch stored: %d accepted, %d duplicates, %d conflicts",
                named.count("accepted"),
                named.count("duplicate"),
                named.count("conflict"),
                extra={"outcome": "batch", "source": source, "messages": chunk},
            )


OUTCOME_NAMES: dict[type, str] = {
    Accepted: "accepted",
    Duplicate: "duplicate",
    Conflict: "conflict",
}


def log_delivery(outcome: str, message: Message, event_id: int) -> None:
    """Log one message's outcome at INFO, with its key, event id and correlation id."""
    log.info(
        "delivery %s",
        outcome,
        extra={
            "outcome": outcome,
            "source": message.source,
            "dedup_key": message.dedup_key,
            "event_id": event_id,
            "correlation_id": message.correlation_id,
        },
    )
