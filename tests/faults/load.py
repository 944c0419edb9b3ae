"""Signed load for the fault suite: who sent what, what came back, what was stored."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import requests
from sqlalchemy import create_engine, text

from ..helpers import signing as s

SOURCE = "stripe-live"
CONFIG = f"""
[sources.{SOURCE}]
provider = "stripe"
secrets = ["{s.STRIPE_SECRET}"]
"""


def event_body(key: str) -> dict[str, object]:
    """The Stripe event behind dedup key ``key``: the same content on every attempt."""
    return {"id": key, "type": "invoice.paid", "data": {"object": {"id": f"in_{key}"}}}


@dataclass(frozen=True)
class Attempt:
    """One HTTP attempt at delivering one key, and what came of it."""

    key: str
    sent: float
    answered: float
    status: int | None  # None: no HTTP answer (connection refused or reset)
    error: str | None = None
    replayed: bool = False
    event_id: int | None = None
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def deliver(session: requests.Session, base_url: str, key: str, timeout: float = 30) -> Attempt:
    """Sign (afresh, as Stripe does on each retry) and post one delivery of ``key``."""
    body, headers = s.stripe_delivery(event_body(key))
    sent = time.monotonic()
    try:
        response = session.post(
            f"{base_url}/webhooks/{SOURCE}", data=body, headers=headers, timeout=timeout
        )
    except requests.RequestException as exc:
        return Attempt(key, sent, time.monotonic(), None, error=type(exc).__name__)
    answered = time.monotonic()
    event_id = problem = None
    if response.headers.get("Content-Type", "").startswith("application/json"):
        event_id = response.json().get("event_id")
    elif response.headers.get("Content-Type", "").startswith("application/problem+json"):
        problem = response.json().get("type")
    return Attempt(
        key,
        sent,
        answered,
        response.status_code,
        replayed=response.headers.get("Idempotent-Replayed") == "true",
        event_id=event_id,
        problem=problem,
    )


class Journal:
    """Every attempt of a run, appended from many threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.attempts: list[Attempt] = []

    def add(self, attempt: Attempt) -> Attempt:
        with self._lock:
            self.attempts.append(attempt)
        return attempt

    def snapshot(self) -> list[Attempt]:
        with self._lock:
            return list(self.attempts)

    def by_key(self) -> dict[str, list[Attempt]]:
        grouped: dict[str, list[Attempt]] = defaultdict(list)
        for attempt in self.attempts:
            grouped[attempt.key].append(attempt)
        return grouped

    def statuses(self) -> Counter[int | str | None]:
        return Counter(a.status if a.status is not None else a.error for a in self.attempts)


@dataclass(frozen=True)
class Stored:
    """What the database holds for one dedup key."""

    rows: int
    event_id: int
    # Its event_duplicates rows (the event's duplicate_count).
    duplicate_count: int


def stored(db_url: str) -> dict[str, Stored]:
    """Read every stored event of the test source, counting rows per dedup key."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT e.dedup_key, count(*) OVER (PARTITION BY e.dedup_key) AS n, e.id,"
                    " (SELECT count(*) FROM event_duplicates d WHERE d.event_id = e.id) AS dups"
                    " FROM events e WHERE e.source = :source"
                ),
                {"source": SOURCE},
            ).all()
    finally:
        engine.dispose()
    result: dict[str, Stored] = {}
    for key, n, event_id, dups in rows:
        # Two rows of one key would collapse here; ``rows`` still counts them.
        result[key] = Stored(n, event_id, dups)
    return result
