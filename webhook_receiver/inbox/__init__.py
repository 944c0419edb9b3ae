"""The inbox: every received message is stored here, whatever its intake.

Intakes (webhooks, the Idempotency-Key API, broker consumers) verify,
identify and answer; the inbox writes. It owns the event row (the dedup
marker, under its unique (source, dedup key) constraint), the event's
deliveries (the transactional outbox), the conflicts kept for review and
the redeliveries' bookkeeping.

- :func:`receive` stores one message, committed before it returns.
- :func:`receive_many` stores a batch in one transaction (the broker
  consumers' unit of work), one outcome per message, with the
  :class:`Position` each partition reads on from (:func:`stored_positions`);
  :func:`stage` builds its rows ahead, where a consumer has the time.
- :func:`add` writes a new event inside the caller's transaction, for an
  intake whose unit of work holds more than the event; inside
  :func:`holding` (PostgreSQL) it holds the event back instead, for the
  caller to write in one statement with its own row (a
  :class:`GuardedReceipt`) or in its transaction (:func:`write_held`).

See docs/architecture.md for the layers and the commit points.
"""

from __future__ import annotations

from flask import Flask
from sqlalchemy.orm import Session

from . import duplicates
from .batch import Staged, receive_many, stage, stored_positions
from .batch_writes import ContentFingerprint
from .held import GuardedReceipt, HeldEvent, ReservedIdTaken, holding, init_held, write_held
from .in_transaction import add
from .messages import Accepted, BatchRefused, Conflict, Duplicate, Message, Outcome
from .one import receive
from .rows import EXTENSION, Position, Routes

__all__ = [
    "Accepted",
    "BatchRefused",
    "Conflict",
    "ContentFingerprint",
    "Duplicate",
    "Message",
    "Outcome",
    "Position",
    "GuardedReceipt",
    "HeldEvent",
    "ReservedIdTaken",
    "Staged",
    "add",
    "holding",
    "init_app",
    "receive",
    "receive_many",
    "stage",
    "stored_positions",
    "write_held",
]


def init_app(app: Flask, routes: Routes) -> None:
    """Give the app its inbox: ``routes`` names the consumers of a new event."""
    app.extensions[EXTENSION] = routes
    duplicates.init_app(app)
    init_held(Session)
