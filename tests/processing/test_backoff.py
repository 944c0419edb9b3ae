"""The retry schedule: exponential steps, jitter, Retry-After as a floor."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from webhook_receiver.database import unit_of_work
from webhook_receiver.outbox import deliveries
from webhook_receiver.processing.backoff import (
    delay_seconds,
    is_retryable_status,
    parse_retry_after,
)

from .conftest import FAST, Reply, config_with, delivery, drain, forward, store_event

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def test_steps_double_from_the_base_up_to_the_cap():
    steps = [delay_seconds(n, base=30, cap=3600, rand=lambda: 1.0) for n in range(1, 9)]
    assert steps == [30, 60, 120, 240, 480, 960, 1920, 3600]


@pytest.mark.parametrize(("rand", "expected"), [(0.0, 15.0), (0.5, 22.5), (1.0, 30.0)])
def test_jitter_spreads_between_half_a_step_and_a_step(rand, expected):
    assert delay_seconds(1, base=30, cap=3600, rand=lambda: rand) == expected


def test_retry_after_is_a_floor_and_has_a_cap():
    kwargs = {"base": 30, "cap": 3600, "rand": lambda: 1.0, "retry_after_cap": 600}
    assert delay_seconds(1, retry_after=120, **kwargs) == 120
    assert delay_seconds(1, retry_after=5, **kwargs) == 30
    assert delay_seconds(1, retry_after=10**6, **kwargs) == 600


def test_retry_after_reads_seconds_and_http_dates():
    assert parse_retry_after("120", NOW) == 120
    assert parse_retry_after(format_datetime(NOW + timedelta(seconds=90), usegmt=True), NOW) == 90
    assert parse_retry_after(format_datetime(NOW - timedelta(seconds=90), usegmt=True), NOW) == 0
    assert parse_retry_after("soon", NOW) is None
    assert parse_retry_after("", NOW) is None
    assert parse_retry_after(None, NOW) is None


@pytest.mark.parametrize(
    ("status", "retryable"),
    [(500, True), (503, True), (408, True), (429, True), (400, False), (404, False), (409, False)],
)
def test_retryable_statuses(status, retryable):
    assert is_retryable_status(status) is retryable


def test_retry_after_with_non_ascii_digits_is_ignored_not_a_crash():
    now = datetime(2026, 12, 2, tzinfo=UTC)
    assert parse_retry_after("\u00b2", now) is None
    assert parse_retry_after("\u0663", now) is None  # ARABIC-INDIC DIGIT THREE


def test_the_step_of_a_late_attempt_is_the_cap_not_an_overflow():
    # 30.0 * 2**1024 is past a float (the worker's settings are floats): the
    # 1026th attempt raised OverflowError.
    for attempt in (64, 65, 1025, 1026, 10**6):
        assert delay_seconds(attempt, base=30.0, cap=3600.0, rand=lambda: 1.0) == 3600


def test_a_forward_with_many_attempts_backs_off_at_its_thousandth_failure(
    make_app, downstream, clock, make_worker
):
    billing = forward("billing", downstream.url + "/billing", max_attempts=5000)
    app = make_app(config_with([billing]), **FAST)
    downstream.replies["/billing"] = [Reply(500, body=b"down")]
    event_id = store_event(app, clock, dedup_key="evt-1")
    with app.app_context(), unit_of_work() as session:
        # As after 1,099 failures (the clock of a test moves no faster).
        session.execute(
            deliveries._t.update().where(deliveries._t.c.event_id == event_id).values(attempts=1099)
        )
    assert drain(app, make_worker(app, clock)) == ["retry"]
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"]) == ("pending", 1100)
    assert row["next_attempt_at"] == clock() + timedelta(seconds=FAST["WORKER_BACKOFF_MAX_SECONDS"])


def test_a_retry_after_past_any_date_is_no_crash_with_a_huge_cap(
    make_app, downstream, clock, make_worker
):
    # An operator's "honour any Retry-After" (a cap of 1e15 s) and a target's
    # absurd one: now + that is past year 9999, OverflowError out of the
    # worker's thread, the delivery leased to the end of its lease each time.
    app = make_app(
        config_with([forward("billing", downstream.url + "/billing")]),
        **FAST,
        WORKER_RETRY_AFTER_MAX_SECONDS=1e15,
    )
    downstream.replies["/billing"] = [Reply(503, {"Retry-After": "9" * 20})]
    event_id = store_event(app, clock, dedup_key="evt-1")
    assert drain(app, make_worker(app, clock)) == ["retry"]
    row = delivery(app, event_id, "billing")
    assert row["state"] == "pending"
    assert row["next_attempt_at"].year > clock().year + 50
