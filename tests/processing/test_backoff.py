"""The retry schedule: exponential steps, jitter, Retry-After as a floor."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from webhook_receiver.processing.backoff import (
    delay_seconds,
    is_retryable_status,
    parse_retry_after,
)

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
