"""The handler interface as a developer writing one uses it, through a real worker."""

from __future__ import annotations

import pytest

from webhook_receiver.processing import handler

from . import misuse_handlers
from .conftest import FAST, config_with, delivery, drain, store_event


@pytest.fixture(autouse=True)
def _reset_misuse():
    misuse_handlers.failures.clear()
    misuse_handlers.during.clear()
    yield
    misuse_handlers.failures.clear()
    misuse_handlers.during.clear()


def _app(make_app, module="tests.processing.misuse_handlers"):
    config = config_with()
    config["handlers"] = [module]
    return make_app(config, **FAST)


def test_a_handler_that_commits_is_refused_and_its_writes_roll_back(
    make_app, clock, make_worker, ledger
):
    app = _app(make_app)
    ledger(app)
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.commits")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    assert ledger(app) == []
    row = delivery(app, event_id, "commits")
    assert row["state"] == "pending"
    assert "must not commit" in row["last_error"]


def test_a_commit_then_a_failure_does_not_write_twice(make_app, clock, make_worker, ledger):
    # Its commit split its writes from the done-marker: the failure after it
    # retried the delivery with the writes already in, and the retry wrote them again.
    app = _app(make_app)
    ledger(app)
    misuse_handlers.failures["commits_then_fails"] = 1
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.commits-then-fails")
    worker = make_worker(app, clock)
    assert drain(app, worker) == ["retry"]
    assert ledger(app) == []
    assert delivery(app, event_id, "commits_then_fails")["attempts"] == 1


def test_a_handler_that_rolls_back_is_refused(make_app, clock, make_worker, ledger):
    app = _app(make_app)
    ledger(app)
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.rolls-back")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    assert ledger(app) == []
    row = delivery(app, event_id, "rolls_back")
    assert "must not commit or roll back" in row["last_error"]


def test_a_handler_s_savepoints_are_its_own(make_app, clock, make_worker, ledger):
    app = _app(make_app)
    ledger(app)
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.savepoint")
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    assert ledger(app) == [(event_id, "savepoint")]


def test_a_handler_s_return_value_is_ignored(make_app, clock, make_worker, ledger):
    app = _app(make_app)
    ledger(app)
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.returns")
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    assert ledger(app) == [(event_id, "returns")]


def test_a_handler_that_outlasts_its_lease_is_delivered_once(make_app, clock, make_worker, ledger):
    # Its row stays locked while it runs, so no other worker takes it over.
    app = _app(make_app)
    ledger(app)
    misuse_handlers.during.append(lambda: clock.advance(FAST["WORKER_LEASE_SECONDS"] * 3))
    event_id = store_event(app, clock, dedup_key="evt-1", event_type="order.slow")
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    assert ledger(app) == [(event_id, "slow")]
    assert delivery(app, event_id, "slow")["attempts"] == 1


def test_a_coroutine_function_is_refused_as_a_handler():
    # Called, it returned a coroutine that nothing awaited: delivered, never run.
    async def record(event, session):
        pass

    with pytest.raises(ValueError, match="handler 'record' is a coroutine function"):
        handler(source="shop")(record)


def test_a_generator_function_is_refused_as_a_handler():
    # Called, it returned a generator: delivered, none of its body run.
    def record(event, session):
        yield session

    with pytest.raises(ValueError, match="handler 'record' is a generator function"):
        handler(source="shop")(record)
