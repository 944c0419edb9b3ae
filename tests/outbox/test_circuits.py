"""The delivery target's record: the circuit's transitions and the rate limit's slots, in SQL.

Each transition is one conditional statement, so that workers racing on
one target agree: one of them opens the circuit, one takes the probe.
"""

from __future__ import annotations

import threading
from datetime import timedelta

from webhook_receiver.database import unit_of_work
from webhook_receiver.extensions import db
from webhook_receiver.outbox import circuits, deliveries

from ..processing.conftest import config_with, delivery_rows, forward, store_event


def _app(make_app):
    return make_app(config_with([forward("billing", "http://127.0.0.1:9/b")]))


def _in(app, func, *args):
    with app.app_context(), unit_of_work():
        return func(*args)


def test_the_failures_th_failure_in_a_row_opens_it_and_only_that_one(make_app, clock):
    app = _app(make_app)
    retry_at = clock() + timedelta(seconds=60)
    opened = [_in(app, circuits.fail, "shop", "billing", clock(), 3, retry_at) for _ in range(5)]
    assert opened == [False, False, True, False, False]
    with app.app_context():
        found = circuits.read("shop", "billing")
    assert (found.state, found.failures, found.opened_at, found.retry_at) == (
        circuits.OPEN,
        3,  # failures of an open circuit (attempts that started before) count nothing
        clock(),
        retry_at,
    )


def test_racing_failures_open_the_circuit_once(make_app, clock):
    app = _app(make_app)
    retry_at = clock() + timedelta(seconds=60)
    results: list[bool] = []
    start = threading.Barrier(8)

    def fail() -> None:
        start.wait()
        results.append(_in(app, circuits.fail, "shop", "billing", clock(), 4, retry_at))

    threads = [threading.Thread(target=fail) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(results) == [False] * 7 + [True]


def test_an_answer_resets_a_closed_circuit_only(make_app, clock):
    app = _app(make_app)
    retry_at = clock() + timedelta(seconds=60)
    _in(app, circuits.fail, "shop", "billing", clock(), 5, retry_at)
    assert _in(app, circuits.answered, "shop", "billing", clock())
    assert not _in(app, circuits.answered, "shop", "billing", clock())  # nothing to reset
    for _ in range(2):
        _in(app, circuits.fail, "shop", "billing", clock(), 2, retry_at)
    assert not _in(app, circuits.answered, "shop", "billing", clock())
    with app.app_context():
        assert circuits.read("shop", "billing").state == circuits.OPEN


def test_one_probe_after_the_cool_down_then_it_closes_or_reopens(make_app, clock):
    app = _app(make_app)
    retry_at = clock() + timedelta(seconds=60)
    _in(app, circuits.fail, "shop", "billing", clock(), 1, retry_at)
    until = retry_at + timedelta(seconds=5)
    assert not _in(app, circuits.take_probe, "shop", "billing", "a", clock(), until)  # cooling
    assert _in(app, circuits.take_probe, "shop", "billing", "a", retry_at, until)
    assert not _in(app, circuits.take_probe, "shop", "billing", "b", retry_at, until)
    assert not _in(app, circuits.close, "shop", "billing", "b", retry_at)  # not b's probe
    later = retry_at + timedelta(seconds=1)
    again = later + timedelta(seconds=60)
    assert _in(app, circuits.reopen, "shop", "billing", "a", later, again)
    with app.app_context():
        found = circuits.read("shop", "billing")
    assert (found.state, found.failures, found.retry_at) == (circuits.OPEN, 2, again)
    assert _in(app, circuits.take_probe, "shop", "billing", "c", again, again)
    # c's worker died: once its time is up, d takes the probe over, and closes it.
    assert _in(app, circuits.take_probe, "shop", "billing", "d", again, again)
    assert not _in(app, circuits.close, "shop", "billing", "c", again)
    assert _in(app, circuits.close, "shop", "billing", "d", again)
    with app.app_context():
        assert circuits.read("shop", "billing") == circuits.Circuit("shop", "billing")


def test_opening_moves_only_the_target_s_pending_deliveries(make_app, clock):
    app = make_app(
        config_with(
            [forward("billing", "http://127.0.0.1:9/b"), forward("crm", "http://127.0.0.1:9/c")],
            client_forwards=[forward("billing", "http://127.0.0.1:9/b")],
        )
    )
    ids = [store_event(app, clock, dedup_key=f"evt-{n}") for n in range(3)]
    other_source = store_event(app, clock, dedup_key="evt-api", source="api:acme")
    with app.app_context(), unit_of_work():
        claim = deliveries.claim_next(clock(), timedelta(seconds=30))
    assert claim is not None and claim.consumer == "billing"
    until = clock() + timedelta(seconds=60)
    assert _in(app, circuits.hold_pending, "shop", "billing", until, clock()) == 2
    due = {
        (r["event_id"], r["consumer"]): (r["state"], r["next_attempt_at"])
        for r in delivery_rows(app)
    }
    assert due[(claim.event_id, "billing")][0] == "in_progress"  # in flight: its worker decides
    for event_id in ids:
        assert due[(event_id, "crm")] == ("pending", clock())
        if event_id != claim.event_id:
            assert due[(event_id, "billing")] == ("pending", until)
    assert due[(other_source, "billing")] == ("pending", clock())  # api:acme's billing


def test_a_delivery_held_back_was_not_attempted(make_app, clock):
    app = _app(make_app)
    store_event(app, clock, dedup_key="evt-1")
    with app.app_context(), unit_of_work():
        claim = deliveries.claim_next(clock(), timedelta(seconds=30))
    assert claim is not None and claim.attempt == 1
    later = clock() + timedelta(seconds=7)
    stale = deliveries.Claim(**{**claim.__dict__, "token": "someone-else"})
    assert not _in(app, circuits.hold_back, stale, clock(), later)  # fenced by the lease
    assert _in(app, circuits.hold_back, claim, clock(), later)
    (row,) = delivery_rows(app)
    assert (row["state"], row["attempts"], row["next_attempt_at"], row["lease_token"]) == (
        "pending",
        0,
        later,
        None,
    )


def test_the_rate_limit_allows_a_second_s_burst_then_one_per_interval(make_app, clock):
    app = _app(make_app)

    def slot(at, max_wait=0.0):
        with app.app_context(), unit_of_work():
            return circuits.take_slot("shop", "billing", at, 10, max_wait)

    now = clock()
    # A quiet target sends 10 at once (one second's worth at 10 per second) ...
    assert [slot(now).wait for _ in range(10)] == [0.0] * 10
    # ... then the next is ready a tenth of a second on.
    refused = slot(now)
    assert refused.wait is None
    assert abs(refused.ready - (now.timestamp() + 0.1)) < 0.002
    # Within max_wait, the slot is reserved ahead: its wait grows by the interval.
    waits = [slot(now, max_wait=0.35).wait for _ in range(4)]
    assert [round(w, 2) for w in waits if w is not None] == [0.1, 0.2, 0.3]
    assert waits[3] is None
    # A second later, 10 more have become due; the reservations came out of them.
    later = now + timedelta(seconds=1)
    assert [slot(later).wait for _ in range(7)] == [0.0] * 7
    assert slot(later).wait is None


def test_targets_of_one_name_on_two_sources_have_their_own_records(make_app, clock):
    app = _app(make_app)
    retry_at = clock() + timedelta(seconds=60)
    _in(app, circuits.fail, "shop", "billing", clock(), 1, retry_at)
    with app.app_context():
        assert circuits.read("api:acme", "billing").state == circuits.CLOSED
        assert [(c.source, c.consumer, c.state) for c in circuits.read_all()] == [
            ("shop", "billing", circuits.OPEN)
        ]
        db.session.rollback()
