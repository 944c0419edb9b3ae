"""Property tests of the Idempotency-Key state machine (hypothesis, stateful).

Any interleaving of first requests, retries, mismatched retries, holders that
finish, fail or crash (claim and never come back), clock jumps past leases
and lifetimes, and purges, must keep at most one effect per key and lifetime,
and every replay must be the saved answer of that effect.

The model predicts the outcome of every step exactly; the database must agree.
Time is driven by passing ``now`` to the record functions (or by the
decorator's clock), so expiry needs no sleeping. Each example starts from
empty tables, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest
from flask.testing import FlaskClient
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import delete, insert, select

from webhook_receiver.database import is_sqlite, unit_of_work
from webhook_receiver.extensions import db
from webhook_receiver.idempotency import decorator
from webhook_receiver.idempotency.persistence import records
from webhook_receiver.models import Event, IdempotencyRecord, utcnow

from ..conftest import bearer
from ..helpers import event_row

LEASE = timedelta(seconds=60)
TTL = timedelta(seconds=300)
KEYS = ("a", "b")
PRINTS = ("print-1", "print-2")
# Steps around the lease and the lifetime, where the state changes.
JUMPS = st.sampled_from([1, 30, 59, 60, 61, 120, 299, 300, 301])
SETTINGS = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
_events = Event.__table__
_records = IdempotencyRecord.__table__


@dataclass
class Holder:
    """A request that claimed a key: it may finish, fail or crash."""

    key: str
    print_: str
    generation: int
    claimed: records.Claimed


@dataclass
class Live:
    """The model's record of a key."""

    state: str
    print_: str
    generation: int
    expires_at: datetime
    token: str | None = None
    lease_expires_at: datetime | None = None
    body: bytes | None = None


def reset() -> None:
    db.session.rollback()
    db.session.execute(delete(_events))
    db.session.execute(delete(_records))
    db.session.commit()


class RecordMachine(RuleBasedStateMachine):
    """Drive records.claim/hold/complete/release directly, under a model."""

    holders = Bundle("holders")

    def __init__(self) -> None:
        super().__init__()
        reset()
        self.now = utcnow().replace(microsecond=0)
        self.model: dict[str, Live] = {}
        self.generations = 0
        # (key, generation) of every effect the model says is committed
        self.effects: set[tuple[str, int]] = set()

    def request(self, key: str, print_: str) -> records.Request:
        return records.Request("prop", key, print_, "POST", "/prop")

    @rule(target=holders, key=st.sampled_from(KEYS), print_=st.sampled_from(PRINTS))
    def send(self, key: str, print_: str):
        """A first request or a retry (with the same or another body)."""
        outcome = records.claim(self.request(key, print_), self.now, LEASE, TTL)
        live = self.model.get(key)
        free = (
            live is None
            or live.expires_at <= self.now
            or (live.state == records.IN_PROGRESS and live.lease_expires_at <= self.now)
        )
        if free:
            assert isinstance(outcome, records.Claimed), outcome
            self.generations += 1
            self.model[key] = Live(
                records.IN_PROGRESS,
                print_,
                self.generations,
                self.now + TTL,
                outcome.token,
                self.now + LEASE,
            )
            return Holder(key, print_, self.generations, outcome)
        if live.state == records.IN_PROGRESS:
            remaining = (live.lease_expires_at - self.now).total_seconds()
            assert outcome == records.InFlight(max(1, math.ceil(remaining)))
        elif live.print_ != print_:
            assert outcome == records.Mismatch()
        else:
            assert outcome == records.Replay(201, [["X-Effect", str(live.generation)]], live.body)
        return multiple()  # no holder

    def _current(self, holder: Holder) -> bool:
        live = self.model.get(holder.key)
        return live is not None and live.token == holder.claimed.token

    @rule(holder=consumes(holders))
    def finish(self, holder: Holder) -> None:
        """The holder runs the effect and saves the answer in one transaction."""
        expected = self._current(holder)
        body = f"effect of {holder.key}#{holder.generation}".encode()
        try:
            records.hold(holder.claimed)
            _effect(holder.key, holder.generation)
            records.complete(
                holder.claimed, 201, [["X-Effect", str(holder.generation)]], body, self.now
            )
            db.session.commit()
        except records.LeaseLost:
            db.session.rollback()
            assert not expected, "a current holder lost its lease"
            return
        assert expected, "a stale holder completed after its key was taken over"
        live = self.model[holder.key]
        live.state, live.token, live.lease_expires_at, live.body = (
            records.COMPLETED,
            None,
            None,
            body,
        )
        self.effects.add((holder.key, holder.generation))

    @rule(holder=consumes(holders))
    def fail(self, holder: Holder) -> None:
        """The holder's view raises: its writes roll back and the key is released."""
        expected = self._current(holder)
        try:
            records.hold(holder.claimed)
        except records.LeaseLost:
            db.session.rollback()
            assert not expected
            return
        _effect(holder.key, holder.generation)
        db.session.rollback()
        with unit_of_work():
            records.release(holder.claimed)
        if expected:
            del self.model[holder.key]
        else:
            # Only SQLite's hold() writes (and so learns of a takeover); on
            # PostgreSQL a stale holder gets this far, and its release,
            # fenced by the lease token, leaves the new holder's record be
            # (database_agrees checks it).
            assert not is_sqlite(), "a stale holder held on SQLite"

    @rule(holder=consumes(holders))
    def crash(self, holder: Holder) -> None:
        """The holder dies between claim and completion: its lease must run out."""

    @rule(seconds=JUMPS)
    def wait(self, seconds: int) -> None:
        self.now += timedelta(seconds=seconds)

    @rule()
    def purge(self) -> None:
        while True:
            with unit_of_work():
                if not records.purge_expired_batch(self.now, 1):
                    break
        for key, live in list(self.model.items()):
            if live.expires_at <= self.now:
                del self.model[key]

    @invariant()
    def database_agrees(self) -> None:
        rows = db.session.execute(
            select(_records.c.key, _records.c.state, _records.c.fingerprint, _records.c.lease_token)
        ).all()
        effects = db.session.execute(select(_events.c.source, _events.c.event_type)).all()
        db.session.rollback()
        assert {r.key: (r.state, r.fingerprint, r.lease_token) for r in rows} == {
            key: (live.state, live.print_, live.token) for key, live in self.model.items()
        }
        seen = [(source.removeprefix("prop:"), int(gen)) for source, gen in effects]
        # At most one effect per key and lifetime, and exactly the committed ones.
        assert len(seen) == len(set(seen))
        assert set(seen) == self.effects


def _effect(key: str, generation: int) -> None:
    # The view's write, in the holder's transaction; the generation tells
    # which lifetime of the key it belongs to.
    db.session.execute(
        insert(_events).values(event_row(source=f"prop:{key}", event_type=str(generation)))
    )


@pytest.mark.slow
def test_record_state_machine_keeps_one_effect_per_key(app):
    with app.app_context():
        run_state_machine_as_test(RecordMachine, settings=SETTINGS)
        reset()


class ApiMachine(RuleBasedStateMachine):
    """The same through POST /api/events, with the decorator's clock under control."""

    client: FlaskClient
    clock: list[datetime]

    def __init__(self) -> None:
        super().__init__()
        reset()
        self.clock[0] = utcnow().replace(microsecond=0)
        # key -> (body variant, saved answer, end of its lifetime)
        self.answers: dict[str, tuple[int, bytes, datetime]] = {}
        # key -> end of the lease of a holder that crashed on it
        self.crashed: dict[str, datetime] = {}
        self.executions = 0

    @property
    def now(self) -> datetime:
        return self.clock[0]

    @rule(key=st.sampled_from(KEYS), n=st.sampled_from([1, 2]))
    def post(self, key: str, n: int) -> None:
        """A first request or a retry, with the same body or another."""
        response = self.client.post(
            "/api/events",
            data=json.dumps({"type": "prop", "data": {"n": n}}),
            content_type="application/json",
            headers={**bearer(), "Idempotency-Key": key},
        )
        if self.crashed.get(key, self.now) > self.now:
            assert response.status_code == 409
            return
        saved = self.answers.get(key)
        if saved is None or saved[2] <= self.now:
            assert response.status_code == 201, response.get_data()
            assert "Idempotent-Replayed" not in response.headers
            self.executions += 1
            self.answers[key] = (n, response.get_data(), self.now + TTL)
            self.crashed.pop(key, None)
        elif saved[0] == n:
            assert response.headers["Idempotent-Replayed"] == "true"
            assert response.get_data() == saved[1]
        else:
            assert response.status_code == 422

    @rule(key=st.sampled_from(KEYS))
    def crashed_holder(self, key: str) -> None:
        """Another worker claims a free key and dies before answering."""
        saved = self.answers.get(key)
        if (saved is not None and saved[2] > self.now) or self.crashed.get(
            key, self.now
        ) > self.now:
            return
        request = records.Request("acme", key, "crashed", "POST", "/api/events")
        assert isinstance(records.claim(request, self.now, LEASE, TTL), records.Claimed)
        self.answers.pop(key, None)
        self.crashed[key] = self.now + LEASE

    @rule(seconds=JUMPS)
    def wait(self, seconds: int) -> None:
        self.clock[0] += timedelta(seconds=seconds)

    @invariant()
    def one_event_per_execution(self) -> None:
        stored = db.session.execute(select(_events.c.id)).all()
        db.session.rollback()
        assert len(stored) == self.executions


@pytest.mark.slow
def test_api_retries_crashes_and_expiry_execute_once_per_lifetime(make_app, monkeypatch):
    app = make_app(IDEMPOTENCY_LEASE_SECONDS=60, IDEMPOTENCY_TTL_SECONDS=300)
    clock = [utcnow()]
    monkeypatch.setattr(decorator, "_now", lambda: clock[0])

    class Machine(ApiMachine):
        pass

    Machine.client = app.test_client()
    Machine.clock = clock
    with app.app_context():
        run_state_machine_as_test(Machine, settings=SETTINGS)
        reset()
