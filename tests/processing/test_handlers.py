"""Handlers (the Inbox pattern): their writes commit with the done-marker, or not at all."""

from __future__ import annotations

from datetime import timedelta

import pytest

from webhook_receiver.config import ConfigError
from webhook_receiver.database import unit_of_work
from webhook_receiver.extensions import db
from webhook_receiver.outbox import deliveries
from webhook_receiver.processing import handler
from webhook_receiver.processing.worker import Worker

from . import handlers
from .conftest import FAST, config_with, delivery, drain, forward, store_event


def _app(make_app, *forwards, **overrides):
    return make_app(config_with(list(forwards), handlers=True), **{**FAST, **overrides})


def test_handler_writes_commit_with_the_delivery(make_app, clock, make_worker, ledger):
    app = _app(make_app)
    ledger(app)
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.paid")
    assert sorted(drain(app, make_worker(app, clock))) == ["delivered", "delivered"]
    assert sorted(ledger(app)) == [(event_id, "audit"), (event_id, "ledger")]
    for name in ("ledger", "audit"):
        row = delivery(app, event_id, name)
        assert (row["kind"], row["state"], row["attempts"]) == ("handler", "delivered", 1)


def test_handler_matches_its_event_type_only(make_app, clock, make_worker, ledger):
    app = _app(make_app)
    ledger(app)
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.refunded")
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    assert ledger(app) == [(event_id, "audit")]


def test_failing_handler_rolls_back_its_writes_and_retries(make_app, clock, make_worker, ledger):
    app = _app(make_app)
    ledger(app)
    handlers.failures["ledger"] = 1
    event_id = store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    assert sorted(drain(app, worker)) == ["delivered", "retry"]
    assert ledger(app) == [(event_id, "audit")]
    row = delivery(app, event_id, "ledger")
    assert (row["state"], row["attempts"], row["last_error"]) == (
        "pending",
        1,
        "RuntimeError: ledger is down",
    )
    assert row["next_attempt_at"] - clock() == timedelta(seconds=1)
    clock.advance(1)
    assert drain(app, worker) == ["delivered"]
    assert sorted(ledger(app)) == [(event_id, "audit"), (event_id, "ledger")]
    assert handlers.calls.count(("ledger", event_id)) == 2


def test_permanent_failure_makes_the_delivery_dead(make_app, clock, make_worker, ledger):
    app = _app(make_app)
    ledger(app)
    handlers.permanent.add("audit")
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.refunded")
    assert drain(app, make_worker(app, clock)) == ["dead"]
    assert ledger(app) == []
    row = delivery(app, event_id, "audit")
    assert (row["state"], row["last_error"]) == (
        "dead",
        f"PermanentFailure: audit refuses event {event_id}",
    )


def test_a_failing_handler_does_not_hold_back_a_forward(
    make_app, clock, make_worker, ledger, downstream
):
    app = _app(make_app, forward("billing", downstream.url + "/billing"))
    ledger(app)
    handlers.failures["audit"] = 5
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.refunded")
    assert sorted(drain(app, make_worker(app, clock))) == ["delivered", "retry"]
    assert delivery(app, event_id, "billing")["state"] == "delivered"
    assert delivery(app, event_id, "audit")["state"] == "pending"
    assert len(downstream.calls_to("/billing")) == 1


def test_handler_whose_lease_was_taken_over_commits_nothing(make_app, clock, ledger):
    app = _app(make_app)
    ledger(app)
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.refunded")
    worker = Worker(app, clock=clock)
    try:
        with app.app_context():
            with unit_of_work():
                stale = deliveries.claim_next(clock(), timedelta(seconds=5))
            # Another worker takes the delivery over after the lease expired...
            with unit_of_work():
                fresh = deliveries.claim_next(clock() + timedelta(seconds=5), timedelta(seconds=5))
            assert fresh.id == stale.id
            # ...so the first one's attempt is fenced off before the handler runs.
            outcome = worker.process(stale)
            assert outcome.outcome == "lease_lost"
            assert handlers.calls == []
            assert worker.process(fresh).outcome == "delivered"
    finally:
        worker.http.close()
    assert ledger(app) == [(event_id, "audit")]
    assert delivery(app, event_id, "audit")["attempts"] == 2


def test_handler_and_forward_of_one_name_on_one_source_are_refused(make_app):
    with pytest.raises(ConfigError, match="two consumers named 'audit'"):
        make_app(config_with([forward("audit", "http://127.0.0.1:9/a")], handlers=True))


def test_handler_names_are_checked():
    with pytest.raises(ValueError, match="handler name"):
        handler(source="shop", name="has space")(lambda event, session: None)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "3"])
def test_a_handler_s_max_attempts_must_be_a_positive_integer(value):
    # 0 made every delivery dead before the handler ran ("out of attempts
    # (0); the last one's lease expired"), as a forward's is refused at load.
    with pytest.raises(ValueError, match="max_attempts"):
        handler(source="shop", name="ledger", max_attempts=value)(lambda event, session: None)


def test_an_unimportable_handler_module_is_a_config_error(make_app):
    config = config_with()
    config["handlers"] = ["tests.processing.no_such_module"]
    with pytest.raises(ConfigError, match="cannot import 'tests.processing.no_such_module'"):
        make_app(config)


def test_a_failed_handler_leaves_no_transaction_open(make_app, clock, ledger):
    app = _app(make_app)
    ledger(app)
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.refunded")
    with app.app_context():
        with unit_of_work():
            claim = deliveries.claim_next(clock(), timedelta(seconds=5))
        worker = Worker(app, clock=clock)
        try:
            handlers.failures["audit"] = 1
            assert worker.process(claim).outcome == "retry"
        finally:
            worker.http.close()
        assert not db.session().in_transaction()
    assert ledger(app) == []
    assert delivery(app, event_id, "audit")["last_error"] == "RuntimeError: audit is down"
