"""Numeric settings past their largest sensible value are refused when the app starts.

A huge finite value passed every check and crashed at first use: 1e300
admin session hours made each login a 500 (OverflowError: the session's end
is past year 9999), a retention of millions of days crashed ``flask purge``,
a statement_timeout past PostgreSQL's 2,147,483,647 ms failed every
connection, a wait past threading.TIMEOUT_MAX raised in the worker's loop.
Each maximum is checked here to be refused above and to work at first use.
"""

from __future__ import annotations

import re
import threading
from datetime import UTC, datetime, timedelta

import pytest

from webhook_receiver import create_app
from webhook_receiver.config import NUMERIC_MAXIMA, NUMERIC_SETTINGS, ConfigError

from ..admin.conftest import PASSWORD, login
from ..helpers import post_event

NO_CAP = {"WORKER_BACKOFF_MAX_SECONDS", "WORKER_RETRY_AFTER_MAX_SECONDS"}


def _start(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", value)
    create_app({"TESTING": True, "RECEIVER_CONFIG": {}})


def _above(name: str) -> str:
    kind, _ = NUMERIC_SETTINGS[name]
    largest, _ = NUMERIC_MAXIMA[name]
    return str(largest + 1) if kind is int else repr(largest + 0.5)


def test_every_numeric_setting_has_a_maximum():
    assert set(NUMERIC_MAXIMA) == set(NUMERIC_SETTINGS)


@pytest.mark.parametrize("name", sorted(set(NUMERIC_SETTINGS) - NO_CAP))
def test_a_setting_above_its_maximum_is_refused_naming_it_and_the_range(monkeypatch, name):
    smallest = NUMERIC_SETTINGS[name][1]
    largest, why = NUMERIC_MAXIMA[name]
    message = (
        f"WEBHOOK_RECEIVER_{name} must be from {smallest:g} to {largest:,} "
        rf"\({re.escape(why)}\), got '?{_above(name)}'?$"
    )
    with pytest.raises(ConfigError, match=message) as refused:
        _start(monkeypatch, name, _above(name))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name", sorted(NUMERIC_SETTINGS))
def test_a_setting_at_its_maximum_is_accepted(monkeypatch, name):
    monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", str(NUMERIC_MAXIMA[name][0]))
    if name == "IDEMPOTENCY_TTL_SECONDS":  # API events must outlive their keys
        monkeypatch.setenv("WEBHOOK_RECEIVER_API_RETENTION_DAYS", "36500")
    app = create_app({"TESTING": True, "RECEIVER_CONFIG": {}})
    assert app.config[name] == NUMERIC_MAXIMA[name][0]


@pytest.mark.parametrize("name", sorted(NO_CAP))
@pytest.mark.parametrize("value", ["inf", "1e300", "1e15"])
def test_a_backoff_cap_may_be_any_size_the_backoff_bounds_the_delay(monkeypatch, name, value):
    # "Honour any Retry-After" (tests/processing/test_backoff.py): the
    # backoff keeps each delay within a century, so no value of these fails.
    _start(monkeypatch, name, value)


def test_admin_session_hours_of_1e300_stop_the_app_rather_than_fail_each_login(
    make_app, monkeypatch
):
    # Before: the app started, and every login was a 500 (OverflowError).
    # The end to end check: this env var through the app factory, as deployed.
    monkeypatch.setenv("WEBHOOK_RECEIVER_ADMIN_SESSION_HOURS", "1e300")
    with pytest.raises(ConfigError, match="WEBHOOK_RECEIVER_ADMIN_SESSION_HOURS must be from"):
        make_app(ADMIN_PASSWORD=PASSWORD)


def test_the_longest_admin_session_and_login_window_let_logins_through(make_app):
    app = make_app(
        ADMIN_PASSWORD=PASSWORD,
        ADMIN_SESSION_HOURS=NUMERIC_MAXIMA["ADMIN_SESSION_HOURS"][0],
        ADMIN_LOGIN_WINDOW_SECONDS=NUMERIC_MAXIMA["ADMIN_LOGIN_WINDOW_SECONDS"][0],
    )
    client = app.test_client()
    assert login(client, password="wrong-password").status_code < 500
    assert login(client).status_code == 302
    assert client.get("/admin/").status_code == 200


def test_the_longest_retention_purges(make_app):
    # Before: a retention of millions of days put the cutoff before year 1
    # and crashed flask purge with OverflowError.
    days = NUMERIC_MAXIMA["API_RETENTION_DAYS"][0]
    app = make_app(API_RETENTION_DAYS=days, DEFAULT_RETENTION_DAYS=days)
    result = app.test_cli_runner().invoke(args=["purge"])
    assert result.exit_code == 0, result.output


def test_the_longest_idempotency_ttl_and_lock_timeout_save_a_request(make_app):
    # PostgreSQL takes the lock timeout in milliseconds, at most 2**31 - 1 of them.
    app = make_app(
        IDEMPOTENCY_TTL_SECONDS=NUMERIC_MAXIMA["IDEMPOTENCY_TTL_SECONDS"][0],
        IDEMPOTENCY_LEASE_SECONDS=NUMERIC_MAXIMA["IDEMPOTENCY_LEASE_SECONDS"][0],
        IDEMPOTENCY_LOCK_TIMEOUT_SECONDS=NUMERIC_MAXIMA["IDEMPOTENCY_LOCK_TIMEOUT_SECONDS"][0],
        API_RETENTION_DAYS=NUMERIC_MAXIMA["API_RETENTION_DAYS"][0],
    )
    client = app.test_client()
    assert post_event(client, key="longest").status_code == 201
    assert post_event(client, key="longest").status_code == 201


def test_the_longest_statement_timeout_is_one_postgresql_takes(make_app):
    # Before: 2,147,484 s and more made every PostgreSQL connection fail
    # (statement_timeout is an int of milliseconds).
    from webhook_receiver.extensions import db

    app = make_app(
        DATABASE_STATEMENT_TIMEOUT_SECONDS=NUMERIC_MAXIMA["DATABASE_STATEMENT_TIMEOUT_SECONDS"][0]
    )
    with app.app_context():
        assert db.session.execute(db.text("SELECT 1")).scalar() == 1


@pytest.mark.parametrize(
    "name",
    [
        "WORKER_POLL_SECONDS",
        "WORKER_LEASE_SECONDS",
        "DUPLICATE_FLUSH_SECONDS",
        "REJECTION_FLUSH_SECONDS",
        "DATABASE_STALL_WARNING_SECONDS",
    ],
)
def test_the_longest_wait_is_one_threading_and_dates_take(name):
    # Waits past threading.TIMEOUT_MAX raise OverflowError in Event.wait and
    # time.sleep; a lease past year 9999 overflows its datetime.
    largest, _ = NUMERIC_MAXIMA[name]
    assert largest <= threading.TIMEOUT_MAX
    datetime.now(UTC) + timedelta(seconds=largest)
