"""The start-up checks: SECRET_KEY when something signs, retention that outlives the keys."""

from __future__ import annotations

import pytest

from webhook_receiver import config as cfg
from webhook_receiver import create_app

from ..conftest import SECRET_KEY
from .conftest import build, dispose

# -- SECRET_KEY -----------------------------------------------------------------


@pytest.mark.parametrize("key", ["too-short", cfg.DEV_SECRET_KEY])
def test_a_weak_secret_key_outside_testing_refuses_to_start(instance, key):
    with pytest.raises(cfg.ConfigError, match="SECRET_KEY"):
        create_app({"RECEIVER_CONFIG": {}, "SECRET_KEY": key})


@pytest.mark.parametrize("key", [None, ""])
def test_no_secret_key_with_the_admin_on_refuses_to_start(instance, key):
    config = {"RECEIVER_CONFIG": {}, "ADMIN_PASSWORD": "a password"}
    if key is not None:
        config["SECRET_KEY"] = key
    with pytest.raises(cfg.ConfigError, match="make instance/secret_key"):
        create_app(config)


def test_no_secret_key_is_needed_when_nothing_signs(instance):
    # Without the admin nothing signs: the receiver, worker and purge run.
    app = create_app({"RECEIVER_CONFIG": {}})
    assert not app.config["SECRET_KEY"]
    dispose(app)


def test_secret_key_is_read_from_the_instance_folder(instance):
    instance.mkdir()
    (instance / "secret_key").write_text(SECRET_KEY + "\n")
    app = create_app({"RECEIVER_CONFIG": {}, "ADMIN_PASSWORD": "a password"})
    assert app.config["SECRET_KEY"] == SECRET_KEY
    dispose(app)


def test_an_empty_secret_key_file_is_named(instance):
    instance.mkdir()
    (instance / "secret_key").write_text("\n")
    with pytest.raises(cfg.ConfigError, match="secret_key is empty"):
        create_app({"RECEIVER_CONFIG": {}})


def test_secret_key_from_the_environment_lets_it_start(instance, monkeypatch):
    monkeypatch.setenv("SECRET_KEY", SECRET_KEY)
    app = create_app({"RECEIVER_CONFIG": {}})
    assert not app.testing
    assert app.config["SECRET_KEY"] == SECRET_KEY
    dispose(app)


def test_testing_gets_a_development_secret_key(instance):
    app = build(RECEIVER_CONFIG={})
    assert app.config["SECRET_KEY"] == cfg.DEV_SECRET_KEY
    dispose(app)


# -- retention ------------------------------------------------------------------


def test_an_idempotency_key_must_outlive_its_lease():
    # Shorter, a request still running holds an expired key: another could
    # take it over and run the same work twice, and the purge delete it.
    settings = {"TESTING": True, "RECEIVER_CONFIG": {}, "IDEMPOTENCY_LEASE_SECONDS": 60}
    with pytest.raises(cfg.ConfigError, match="a key must outlive the request it holds"):
        create_app({**settings, "IDEMPOTENCY_TTL_SECONDS": 59})
    assert (
        create_app({**settings, "IDEMPOTENCY_TTL_SECONDS": 60}).config["IDEMPOTENCY_TTL_SECONDS"]
        == 60
    )


def test_api_retention_must_outlive_idempotency_keys():
    with pytest.raises(cfg.ConfigError, match="API events must outlive their keys"):
        create_app(
            {
                "TESTING": True,
                "RECEIVER_CONFIG": {},
                "API_RETENTION_DAYS": 1,
                "IDEMPOTENCY_TTL_SECONDS": 2 * 86400,
            }
        )
