"""Handlers for the processing tests, loaded through ``handlers = ["tests.processing.handlers"]``.

Each writes a row to its own table, so a test can see whether the handler's
writes committed with its delivery.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table

from webhook_receiver.processing import PermanentFailure, handler

ledger = Table(
    "test_ledger",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("event_id", Integer, nullable=False),
    Column("consumer", String(50), nullable=False),
)

# Set by tests: how many of the next calls of a handler fail after writing.
failures: dict[str, int] = {}
permanent: set[str] = set()
# Set by tests: the message of a handler's failure, when not "<name> is down".
failure_messages: dict[str, str] = {}
calls: list[tuple[str, int]] = []


def reset() -> None:
    failures.clear()
    permanent.clear()
    failure_messages.clear()
    calls.clear()


def _apply(name: str, event: Any, session: Any) -> None:
    calls.append((name, event.id))
    session.execute(ledger.insert().values(event_id=event.id, consumer=name))
    if name in permanent:
        raise PermanentFailure(f"{name} refuses event {event.id}")
    if failures.get(name, 0) > 0:
        failures[name] -= 1
        raise RuntimeError(failure_messages.get(name, f"{name} is down"))


@handler(source="shop", event_type="order.paid", name="ledger")
def record_payment(event: Any, session: Any) -> None:
    _apply("ledger", event, session)


@handler(source="shop", name="audit")
def audit_everything(event: Any, session: Any) -> None:
    _apply("audit", event, session)
