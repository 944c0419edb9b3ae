"""Numbers that are no amount of time or size (nan, inf) are refused when the app starts.

A nan poll or lease passed every "at least" check (nan < x is false), and
the worker then spun or never leased; inf slept for ever or overflowed a
timedelta. TOML and Flask's JSON reading of the environment both give
these floats, as does a plain "nan" string through float().
"""

from __future__ import annotations

import pytest

from webhook_receiver import create_app
from webhook_receiver.config import NUMERIC_SETTINGS, ConfigError, load_file
from webhook_receiver.webhooks.providers import PROVIDERS

# A cap set to inf means "no cap" (the backoff keeps any delay within a
# century): honoured, as it always was. nan means nothing anywhere.
NO_CAP = {"WORKER_BACKOFF_MAX_SECONDS", "WORKER_RETRY_AFTER_MAX_SECONDS"}
FLOAT_SETTINGS = sorted(name for name, (kind, _) in NUMERIC_SETTINGS.items() if kind is float)
INT_SETTINGS = sorted(name for name, (kind, _) in NUMERIC_SETTINGS.items() if kind is int)


def _start(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", value)
    create_app({"TESTING": True, "RECEIVER_CONFIG": {}})


@pytest.mark.parametrize("name", FLOAT_SETTINGS)
@pytest.mark.parametrize("value", ["nan", "NaN", "-nan"])
def test_a_nan_float_setting_is_refused_naming_it(monkeypatch, name, value):
    # "NaN" is read as JSON by Flask (a float nan), "nan" as a string float() reads.
    with pytest.raises(ConfigError, match=f"WEBHOOK_RECEIVER_{name} must be a finite number"):
        _start(monkeypatch, name, value)


@pytest.mark.parametrize("name", [n for n in FLOAT_SETTINGS if n not in NO_CAP])
@pytest.mark.parametrize("value", ["inf", "Infinity", "-inf", "1e999"])
def test_an_infinite_float_setting_is_refused_naming_it(monkeypatch, name, value):
    with pytest.raises(ConfigError, match=f"WEBHOOK_RECEIVER_{name} must be a finite number"):
        _start(monkeypatch, name, value)


@pytest.mark.parametrize("name", sorted(NO_CAP))
def test_a_cap_of_inf_still_means_no_cap(monkeypatch, name):
    monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", "inf")
    app = create_app({"TESTING": True, "RECEIVER_CONFIG": {}})
    assert app.config[name] == float("inf")
    monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", "-inf")
    with pytest.raises(ConfigError, match=f"WEBHOOK_RECEIVER_{name} must be at least 0"):
        create_app({"TESTING": True, "RECEIVER_CONFIG": {}})


@pytest.mark.parametrize("name", INT_SETTINGS)
@pytest.mark.parametrize("value", ["Infinity", "NaN"])
def test_an_integer_setting_of_inf_or_nan_is_a_config_error(monkeypatch, name, value):
    # Infinity read as JSON is a float, and int() of it raised OverflowError:
    # a traceback, not the one line naming the setting.
    with pytest.raises(ConfigError, match=f"WEBHOOK_RECEIVER_{name} must be an integer"):
        _start(monkeypatch, name, value)


def test_a_finite_float_setting_is_still_accepted(monkeypatch):
    monkeypatch.setenv("WEBHOOK_RECEIVER_WORKER_POLL_SECONDS", "0.25")
    monkeypatch.setenv("WEBHOOK_RECEIVER_WORKER_LEASE_SECONDS", "90")
    app = create_app({"TESTING": True, "RECEIVER_CONFIG": {}})
    assert app.config["WORKER_POLL_SECONDS"] == 0.25
    assert app.config["WORKER_LEASE_SECONDS"] == 90.0


FORWARD = (
    '[sources.shop]\nprovider = "github"\nsecrets = ["s3cret-0123456789"]\n'
    '[[sources.shop.forward]]\nname = "crm"\nurl = "http://127.0.0.1:9/in"\n'
)


@pytest.mark.parametrize(
    ("line", "setting"),
    [
        ("timeout_seconds = nan", "timeout_seconds"),
        ("timeout_seconds = inf", "timeout_seconds"),
        ("max_per_second = nan", "max_per_second"),
        ("max_per_second = inf", "max_per_second"),
        ("circuit_breaker = { cool_down_seconds = nan }", "cool_down_seconds"),
        ("circuit_breaker = { cool_down_seconds = inf }", "cool_down_seconds"),
    ],
)
def test_a_forwards_nan_or_inf_in_the_file_is_refused_naming_it(tmp_path, line, setting):
    # A nan timeout passed "<= 0"; inf never timed out, outliving the lease.
    path = tmp_path / "receiver.toml"
    path.write_text(FORWARD + line + "\n")
    with pytest.raises(ConfigError, match=rf"\[\[sources.shop.forward\]\] crm: .*{setting}"):
        load_file(path, required=True, providers=PROVIDERS)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        (
            "ADMIN_SESSION_HOURS",
            "nan",
            "must be a finite number from 0.01 to 8,760 (1 year: a session's end stays a date), "
            "got 'nan'",
        ),
        (
            "WORKER_POLL_SECONDS",
            "inf",
            "must be a finite number from 0.001 to 86,400 (1 day: new deliveries wait that long), "
            "got 'inf'",
        ),
        (
            "WORKER_BACKOFF_MAX_SECONDS",
            "nan",
            "must be a finite number of at least 0, or inf (none: a delay stays within a "
            "century), got 'nan'",
        ),
    ],
)
def test_a_nan_or_inf_setting_is_refused_naming_its_range(monkeypatch, name, value, expected):
    # It said "must be a finite number, got 'nan'" and no range, where 99999
    # named it; the README promises the range for every such value.
    with pytest.raises(ConfigError) as info:
        _start(monkeypatch, name, value)
    assert str(info.value) == f"WEBHOOK_RECEIVER_{name} {expected}"
