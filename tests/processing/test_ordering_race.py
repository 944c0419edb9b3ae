"""Ordering under concurrency: two transactions advancing one entity, two workers sending it."""

from __future__ import annotations

import threading
from datetime import timedelta

from sqlalchemy import select

from webhook_receiver.database import unit_of_work
from webhook_receiver.extensions import db
from webhook_receiver.models import EntityVersion
from webhook_receiver.outbox import circuits, deliveries, ordering
from webhook_receiver.processing import limits

from .conftest import FAST, config_with, delivery, drain, forward, store_event


def test_an_older_version_waits_for_the_newer_ones_transaction_and_loses(make_app, clock):
    # Two handler transactions of one entity, 3 first: 2's upsert must wait for
    # 3's transaction (PostgreSQL's row/index lock, SQLite's write lock) and
    # then see 3, not decide on what it read before 3 committed.
    app = make_app(config_with(handlers=True, ordered=True), **FAST)
    v3 = store_event(app, clock, dedup_key="evt-3", data={})
    v2 = store_event(app, clock, dedup_key="evt-2", data={})
    three = ordering.Key("audit:cus_1", ordering.sortable(3))
    two = ordering.Key("audit:cus_1", ordering.sortable(2))
    advanced, release = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def newer() -> None:
        with app.app_context():
            with unit_of_work():
                results["3"] = ordering.advance("shop", three, v3, clock())
                advanced.set()
                release.wait(10)  # the handler runs, its transaction open

    def older() -> None:
        with app.app_context():
            try:
                with unit_of_work():
                    results["2"] = ordering.advance("shop", two, v2, clock())
            except Exception as exc:  # the test reports it, not the thread
                results["2"] = exc

    first = threading.Thread(target=newer)
    first.start()
    assert advanced.wait(10)
    second = threading.Thread(target=older)
    second.start()
    second.join(0.5)
    assert second.is_alive(), "2 decided while 3's transaction was still open"
    release.set()
    first.join(10)
    second.join(10)
    assert results == {"3": True, "2": False}
    with app.app_context():
        got = db.session.execute(select(EntityVersion.version, EntityVersion.event_id)).all()
        db.session.rollback()
    assert [tuple(r) for r in got] == [(ordering.sortable(3), v3)]


def _version_event(app, clock, key: str, version: int) -> int:
    return store_event(
        app, clock, dedup_key=key, data={"object": {"id": "cus_1", "version": version}}
    )


def _ordered_app(make_app, downstream):
    return make_app(
        config_with([forward("billing", downstream.url + "/billing")], ordered=True), **FAST
    )


def _second_held_while_first_sends(app, downstream, clock, make_worker):
    """Hold the first worker's call downstream, in a thread; the second worker's claim is held.

    Returns the second worker, the sending thread, and (once it ends) the
    first worker's outcome.
    """
    downstream.blocking.add("/billing")  # the call is done downstream, not answered
    first, second = make_worker(app, clock), make_worker(app, clock)
    outcomes: list[object] = []

    def send() -> None:
        with app.app_context():
            outcome = first.run_once()
            outcomes.append(outcome.outcome if outcome else None)

    sending = threading.Thread(target=send)
    sending.start()
    assert downstream.arrived.wait(10)
    with app.app_context():
        held = second.run_once()
    assert held is not None and held.outcome == "held"
    return second, sending, outcomes


def test_a_forward_waits_while_another_version_of_its_entity_is_being_sent(
    make_app, downstream, clock, make_worker
):
    # Two workers, versions 2 and 3 of one entity. Both pass the stale check
    # (nothing applied yet); were both sent at once, 2 could arrive after 3.
    # 3's worker finds 2's call in flight and gives 3 back unattempted.
    app = _ordered_app(make_app, downstream)
    _version_event(app, clock, "evt-2", 2)
    v3 = _version_event(app, clock, "evt-3", 3)
    second, sending, outcomes = _second_held_while_first_sends(app, downstream, clock, make_worker)
    assert [c.body for c in downstream.calls_to("/billing")] == [downstream.calls[0].body]
    row = delivery(app, v3, "billing")
    # Unattempted: its attempt is not counted; due again after a recheck.
    assert (row["state"], row["attempts"]) == ("pending", 0)
    downstream.gate.set()
    sending.join(10)
    assert outcomes == ["delivered"]  # version 2's
    assert drain(app, second) == []  # not due yet
    clock.advance(limits.RECHECK_SECONDS)
    assert drain(app, second) == ["delivered"]
    sent = [c.headers["Idempotency-Key"] for c in downstream.calls_to("/billing")]
    assert sent == ["billing:shop:evt-2", "billing:shop:evt-3"]


def test_an_older_version_given_back_behind_a_newer_one_is_skipped_after_it(
    make_app, downstream, clock, make_worker
):
    # 3 is being sent when 2 is claimed: 2 waits, then finds 3 applied.
    app = _ordered_app(make_app, downstream)
    _version_event(app, clock, "evt-3", 3)
    v2 = _version_event(app, clock, "evt-2", 2)
    second, sending, _ = _second_held_while_first_sends(app, downstream, clock, make_worker)
    downstream.gate.set()
    sending.join(10)
    clock.advance(limits.RECHECK_SECONDS)
    assert drain(app, second) == ["skipped"]
    assert delivery(app, v2, "billing")["state"] == "skipped"
    assert [c.headers["Idempotency-Key"] for c in downstream.calls] == ["billing:shop:evt-3"]


def test_an_entity_is_taken_over_once_its_sender_is_no_longer_in_flight(make_app, clock):
    # Nothing releases an entity: the delivery named stops holding it when
    # it is no longer claimed under a running lease.
    app = make_app(
        config_with([forward("billing", "http://127.0.0.1:9/billing")], ordered=True), **FAST
    )
    one = _version_event(app, clock, "evt-1", 1)
    two = _version_event(app, clock, "evt-2", 2)
    key = ordering.Key("billing:cus_1", ordering.sortable(2))
    with app.app_context():
        with unit_of_work():
            first = deliveries.claim_next(clock(), timedelta(seconds=5))
        with unit_of_work():  # claimed 3 s later: its lease runs 3 s longer
            second = deliveries.claim_next(clock.advance(3), timedelta(seconds=5))
        assert first is not None and second is not None
        assert {first.event_id, second.event_id} == {one, two}
        with unit_of_work():
            assert ordering.take_entity(first, "shop", key, clock())
        with unit_of_work():
            assert ordering.take_entity(first, "shop", key, clock())  # its own, again
            assert not ordering.take_entity(second, "shop", key, clock())  # in flight
        # The first's lease runs out (its worker died): the entity is free.
        later = clock.advance(3)
        with unit_of_work():
            assert ordering.take_entity(second, "shop", key, later)
        with unit_of_work():
            assert not ordering.take_entity(first, "shop", key, later)
        # The second is given back (a gate held it, a failure to retry): free again.
        with unit_of_work():
            assert circuits.hold_back(second, later, later)
        with unit_of_work():
            assert ordering.take_entity(first, "shop", key, later)
        rows = db.session.execute(
            select(EntityVersion.version, EntityVersion.sending_delivery_id)
        ).all()
        db.session.rollback()
    # No version applied yet: the row only names who sends.
    assert [tuple(r) for r in rows] == [(ordering.NONE_APPLIED, first.id)]
