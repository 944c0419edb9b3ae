"""Handlers that end the worker's transaction themselves, which they must not do.

Each writes a row to the processing tests' ledger first (see ``handlers``).
"""

from __future__ import annotations

from typing import Any

from webhook_receiver.processing import handler

from .handlers import ledger

# Set by tests: how many of the next calls of ``commits_then_fails`` fail after committing.
failures: dict[str, int] = {}


@handler(source="shop", event_type="order.commits", name="commits")
def commits(event: Any, session: Any) -> None:
    session.execute(ledger.insert().values(event_id=event.id, consumer="commits"))
    session.commit()


@handler(source="shop", event_type="order.commits-then-fails", name="commits_then_fails")
def commits_then_fails(event: Any, session: Any) -> None:
    session.execute(ledger.insert().values(event_id=event.id, consumer="commits_then_fails"))
    session.commit()
    if failures.get("commits_then_fails", 0) > 0:
        failures["commits_then_fails"] -= 1
        raise RuntimeError("the mail server is down")


@handler(source="shop", event_type="order.rolls-back", name="rolls_back")
def rolls_back(event: Any, session: Any) -> None:
    session.execute(ledger.insert().values(event_id=event.id, consumer="before"))
    session.rollback()
    session.execute(ledger.insert().values(event_id=event.id, consumer="rolls_back"))


@handler(source="shop", event_type="order.returns", name="returns")
def returns_a_value(event: Any, session: Any) -> bool:
    session.execute(ledger.insert().values(event_id=event.id, consumer="returns"))
    return False


# Set by tests: called while ``slow`` runs (a test's clock moving past the lease).
during: list[Any] = []


@handler(source="shop", event_type="order.slow", name="slow")
def slow(event: Any, session: Any) -> None:
    session.execute(ledger.insert().values(event_id=event.id, consumer="slow"))
    for call in during:
        call()


@handler(source="api:acme", name="from_acme")
def from_acme(event: Any, session: Any) -> None:
    pass


@handler(source="shop", event_type="order.savepoint", name="savepoint")
def uses_a_savepoint(event: Any, session: Any) -> None:
    with session.begin_nested():
        session.execute(ledger.insert().values(event_id=event.id, consumer="savepoint"))
    nested = session.begin_nested()
    session.execute(ledger.insert().values(event_id=event.id, consumer="undone"))
    nested.rollback()
