"""WEBHOOK_RECEIVER_* variables the receiver does not read stop the start, naming them.

Flask's from_prefixed_env takes every variable of the prefix into the
config: a misspelled one (WORKER_THREAD for WORKER_THREADS) was a setting
nobody read, and the default ran without a word.
"""

from __future__ import annotations

import pytest

from webhook_receiver import create_app
from webhook_receiver.config import DEFAULTS, ConfigError

from .conftest import flask_consume_list


def _start() -> None:
    create_app({"TESTING": True, "RECEIVER_CONFIG": {}})


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("WORKER_THREAD", "WORKER_THREADS"),
        ("ADMIN_PASSWROD", "ADMIN_PASSWORD"),
        ("IDEMPOTENCY_TTL", "IDEMPOTENCY_TTL_SECONDS"),
        ("SQLALCHEMY_ENGINE_OPTION__pool_size", "SQLALCHEMY_ENGINE_OPTIONS"),
        ("DATABASE_URL", "DATABASE_URL"),
        ("SQLALCHEMY_DATABASE_URI", "DATABASE_URL"),
        ("MAX_CONTENT_LENGTH", "WEBHOOK_RECEIVER_MAX_BODY_BYTES"),
    ],
)
def test_a_misspelled_variable_is_refused_naming_the_likely_one(monkeypatch, name, meant):
    monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", "8")
    with pytest.raises(ConfigError) as info:
        _start()
    meant = meant if meant.startswith(("WEBHOOK_", "DATABASE_URL")) else f"WEBHOOK_RECEIVER_{meant}"
    assert str(info.value) == (
        f"WEBHOOK_RECEIVER_{name} is not a setting the receiver reads: did you mean {meant}?"
    )


def test_an_unknown_variable_with_no_close_name_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("WEBHOOK_RECEIVER_XYZZY", "hunter2-secret")
    with pytest.raises(ConfigError) as info:
        _start()
    assert str(info.value) == "WEBHOOK_RECEIVER_XYZZY is not a setting the receiver reads"


def test_every_setting_and_flask_setting_is_still_taken(monkeypatch, tmp_path):
    config = tmp_path / "receiver.toml"
    config.write_text("")
    monkeypatch.setenv("WEBHOOK_RECEIVER_CONFIG", str(config))
    for name, value in DEFAULTS.items():
        if value is not None and not isinstance(value, dict):
            monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", str(value).lower())
    # The README: any other Flask setting can be given with the prefix, and
    # the engine's options key by key (Flask's "__" nesting).
    monkeypatch.setenv("WEBHOOK_RECEIVER_PREFERRED_URL_SCHEME", "https")
    monkeypatch.setenv("WEBHOOK_RECEIVER_SQLALCHEMY_ENGINE_OPTIONS__pool_pre_ping", "true")
    monkeypatch.setenv("WEBHOOK_RECEIVER_SECRET_KEY", "a long enough secret key for this")
    app = create_app({"TESTING": True})
    assert app.config["PREFERRED_URL_SCHEME"] == "https"
    assert app.config["SQLALCHEMY_ENGINE_OPTIONS"]["pool_pre_ping"] is True
    assert app.config["WORKER_THREADS"] == DEFAULTS["WORKER_THREADS"]


def test_the_flask_cli_says_a_misspelled_variable_in_one_line(tmp_path):
    (tmp_path / "none.toml").write_text("")
    done = flask_consume_list(
        WEBHOOK_RECEIVER_WORKER_THREAD="8", WEBHOOK_RECEIVER_CONFIG=str(tmp_path / "none.toml")
    )
    assert done.returncode != 0
    assert (
        "Error: WEBHOOK_RECEIVER_WORKER_THREAD is not a setting the receiver reads: "
        "did you mean WEBHOOK_RECEIVER_WORKER_THREADS?"
    ) in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("name", ["WORKER_THREADS__x", "ADMIN_PASSWORD__x", "SECRET_KEY__a__b"])
def test_a_name_nested_in_a_setting_that_is_no_table_is_one_line(monkeypatch, name):
    # Flask's from_prefixed_env sets A__B as config[A][B]: inside a number or
    # a string that was its TypeError traceback, before any check ran.
    monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", "1")
    setting = name.partition("__")[0]
    with pytest.raises(ConfigError) as info:
        _start()
    assert str(info.value) == (
        f"WEBHOOK_RECEIVER_{name}: WEBHOOK_RECEIVER_{setting} is not a table of settings: "
        f"set WEBHOOK_RECEIVER_{setting} itself"
    )


def test_a_name_nested_in_a_table_setting_is_still_taken(monkeypatch):
    monkeypatch.setenv("WEBHOOK_RECEIVER_SQLALCHEMY_ENGINE_OPTIONS__pool_size", "3")
    app = create_app({"TESTING": True, "RECEIVER_CONFIG": {}})
    assert app.config["SQLALCHEMY_ENGINE_OPTIONS"]["pool_size"] == 3
