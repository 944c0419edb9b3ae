"""Configuration: the TOML file, the environment, the database URL and the SQLite defaults."""

from __future__ import annotations

import subprocess
from datetime import timedelta

import pytest
from flask import Flask
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from webhook_receiver import config as cfg
from webhook_receiver import create_app
from webhook_receiver.extensions import db
from webhook_receiver.idempotency import records
from webhook_receiver.models import EventDuplicate, IdempotencyRecord, utcnow
from webhook_receiver.webhooks.providers import PROVIDERS

from .conftest import ACME_TOKEN, SECRET_KEY, bearer
from .servers import BIN, ROOT, app_env

GOOD_TOML = f'[clients.acme]\ntoken = "{ACME_TOKEN}"\n'


@pytest.fixture
def instance(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Give apps built here an instance folder of the test's own, not the checkout's."""
    path = tmp_path / "instance"
    monkeypatch.setattr(Flask, "auto_find_instance_path", lambda self: str(path))
    return path


def build(**config) -> Flask:
    """An app that reads its TOML file and environment for real (no RECEIVER_CONFIG)."""
    return create_app({"TESTING": True, **config})


def dispose(app: Flask) -> None:
    with app.app_context():
        db.session.remove()
        db.engine.dispose()


# -- the TOML file ------------------------------------------------------------


def test_malformed_toml_names_the_file_and_the_problem(instance, tmp_path, monkeypatch):
    path = tmp_path / "broken.toml"
    path.write_text('[clients.acme\ntoken = "x"\n')
    monkeypatch.setenv("WEBHOOK_RECEIVER_CONFIG", str(path))
    with pytest.raises(cfg.ConfigError) as info:
        build()
    message = str(info.value)
    assert str(path) in message
    assert "not valid TOML" in message
    assert "line 1" in message


def test_malformed_toml_stops_the_flask_cli_with_the_message(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('[clients.acme]\ntoken = "unterminated\n')
    db_path = tmp_path / "app.sqlite3"
    result = subprocess.run(
        [str(BIN / "flask"), "--app", "wsgi", "routes"],
        cwd=ROOT,
        env=app_env(f"sqlite:///{db_path}", path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    # One line naming the file and the problem, no traceback.
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("Error: ")
    assert str(path) in result.stderr
    assert "not valid TOML" in result.stderr
    assert "/api/events" not in result.stdout  # no routes listed: it never started


def test_the_flask_cli_starts_with_a_good_file(tmp_path):
    path = tmp_path / "good.toml"
    path.write_text(GOOD_TOML)
    result = subprocess.run(
        [str(BIN / "flask"), "--app", "wsgi", "routes"],
        cwd=ROOT,
        env=app_env(f"sqlite:///{tmp_path / 'app.sqlite3'}", path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "/api/events" in result.stdout
    assert "/readyz" in result.stdout


def test_explicit_config_path_that_does_not_exist_is_an_error(instance, tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / "config.toml"
    monkeypatch.setenv("WEBHOOK_RECEIVER_CONFIG", str(missing))
    with pytest.raises(cfg.ConfigError, match="config file not found") as info:
        build()
    assert str(missing) in str(info.value)


def test_default_config_file_missing_is_an_empty_config(instance):
    app = build()
    file_config = app.config["FILE_CONFIG"]
    assert file_config.path == str(instance / "config.toml")
    assert file_config.clients == {}
    assert file_config.sources == {}
    dispose(app)


def test_default_config_file_in_the_instance_folder_is_read(instance):
    instance.mkdir()
    (instance / "config.toml").write_text(GOOD_TOML)
    app = build()
    client = app.config["FILE_CONFIG"].client_for_token(ACME_TOKEN)
    assert client is not None and client.name == "acme"
    dispose(app)


def test_config_file_from_the_environment_is_used(instance, tmp_path, monkeypatch):
    path = tmp_path / "receiver.toml"
    path.write_text(GOOD_TOML)
    monkeypatch.setenv("WEBHOOK_RECEIVER_CONFIG", str(path))
    app = build()
    assert app.config["FILE_CONFIG"].path == str(path)
    assert set(app.config["FILE_CONFIG"].clients) == {"acme"}
    dispose(app)


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('[clients.acme]\ntoken = "short"\n', r"\[clients.acme\] token must be a string of 16\+"),
        ("[clients.acme]\ntoken = 12345678901234567890\n", r"token must be a string"),
        ("[clients.acme]\n", r"token must be a string"),
        (
            f'[clients.a]\ntoken = "{ACME_TOKEN}"\n[clients.b]\ntoken = "{ACME_TOKEN}"\n',
            "two clients share one token",
        ),
        (
            f'[clients.acme]\ntoken = "{ACME_TOKEN}"\nscopes = ["all"]\n',
            r"\[clients.acme\] unknown key\(s\): scopes",
        ),
        (f'[client.acme]\ntoken = "{ACME_TOKEN}"\n', r"unknown top-level key\(s\): client"),
        ('clients = "acme"\n', r"\[clients\] must hold tables"),
        (
            '[sources.shop]\nprovider = "paypal"\nsecrets = ["s3cret"]\n',
            r"\[sources.shop\] provider must be one of",
        ),
        ("[sources.shop]\n", r"\[sources.shop\] provider must be one of"),
        ('[sources.shop]\nprovider = "github"\n', r"\[sources.shop\] secrets must be"),
        ('handlers = "mymodule"\n', "handlers must be a list"),
        (
            '[sources.shop]\nprovider = "github"\nsecrets = ["s"]\ntolerence_seconds = 60\n',
            r"\[sources.shop\] unknown key\(s\) for provider github: tolerence_seconds",
        ),
        (
            '[sources.shop]\nprovider = "stripe"\nsecrets = ["s"]\nevent_type = "json:/t"\n',
            r"\[sources.shop\] unknown key\(s\) for provider stripe: event_type",
        ),
        (
            '[sources.shop]\nprovider = "github"\nsecrets = ["s"]\n'
            '[[sources.shop.forward]]\nname = "f"\nurl = "http://x"\ntimout_seconds = 1\n',
            r"\[\[sources.shop.forward\]\] f: unknown key\(s\): timout_seconds",
        ),
    ],
    ids=[
        "short-token",
        "non-string-token",
        "missing-token",
        "duplicate-token",
        "unknown-client-key",
        "unknown-top-level-key",
        "clients-not-tables",
        "bad-provider",
        "missing-provider",
        "missing-secrets",
        "handlers-not-a-list",
        "unknown-source-key",
        "key-of-another-provider",
        "unknown-forward-key",
    ],
)
def test_invalid_config_file_is_refused_with_its_path(
    instance, tmp_path, monkeypatch, toml, expected
):
    path = tmp_path / "receiver.toml"
    path.write_text(toml)
    monkeypatch.setenv("WEBHOOK_RECEIVER_CONFIG", str(path))
    with pytest.raises(cfg.ConfigError, match=expected) as info:
        build()
    assert str(info.value).startswith(f"{path}: ")


def test_token_lookup_finds_only_exact_tokens():
    file_config = cfg.parse({"clients": {"acme": {"token": ACME_TOKEN}}}, providers=PROVIDERS)
    assert file_config.client_for_token(ACME_TOKEN).name == "acme"
    assert file_config.client_for_token(ACME_TOKEN[:-1]) is None
    assert file_config.client_for_token(ACME_TOKEN + " ") is None
    assert file_config.client_for_token("") is None
    assert ACME_TOKEN not in repr(file_config)


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


# -- DATABASE_URL -------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgres://u:p@db.example:5432/app", "postgresql+psycopg://u:p@db.example:5432/app"),
        ("postgresql://u:p@db.example/app", "postgresql+psycopg://u:p@db.example/app"),
        ("postgresql+psycopg://u@h/app", "postgresql+psycopg://u@h/app"),
        ("sqlite:////var/lib/app.sqlite3", "sqlite:////var/lib/app.sqlite3"),
    ],
)
def test_database_url_is_mapped_to_psycopg(instance, monkeypatch, url, expected):
    assert cfg.database_uri(url, "/unused") == expected
    monkeypatch.setenv("DATABASE_URL", url)
    app = build(RECEIVER_CONFIG={})
    assert app.config["SQLALCHEMY_DATABASE_URI"] == expected
    with app.app_context():
        engine = db.engine
        if expected.startswith("postgresql"):
            assert (engine.dialect.name, engine.dialect.driver) == ("postgresql", "psycopg")
            assert engine.url.render_as_string(hide_password=False) == expected
    dispose(app)


def test_postgres_url_given_in_test_config_is_mapped_too(instance):
    app = build(RECEIVER_CONFIG={}, SQLALCHEMY_DATABASE_URI="postgres://u@h/app")
    assert app.config["SQLALCHEMY_DATABASE_URI"] == "postgresql+psycopg://u@h/app"
    dispose(app)


def test_default_database_is_sqlite_in_the_instance_folder_tuned_for_workers(instance):
    app = build(RECEIVER_CONFIG={})
    path = instance / "webhook_receiver.sqlite3"
    assert app.config["SQLALCHEMY_DATABASE_URI"] == f"sqlite:///{path}"
    with app.app_context():
        with db.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
    dispose(app)
    assert path.exists()


def test_foreign_keys_are_enforced_on_both_databases(make_app):
    app = make_app()
    with app.app_context():
        db.session.add(EventDuplicate(event_id=999_999, received_at=utcnow()))
        with pytest.raises(IntegrityError):
            db.session.commit()
        db.session.rollback()


# -- WEBHOOK_RECEIVER_* settings ----------------------------------------------


def test_max_body_bytes_from_the_environment(make_app, monkeypatch):
    monkeypatch.setenv("WEBHOOK_RECEIVER_MAX_BODY_BYTES", "2048")
    app = make_app()
    assert app.config["MAX_BODY_BYTES"] == 2048
    assert app.config["MAX_CONTENT_LENGTH"] == 2048
    client = app.test_client()
    headers = {**bearer(), "Idempotency-Key": "big"}
    small = {"type": "t", "data": "x" * 1000}
    big = {"type": "t", "data": "x" * 3000}
    assert client.post("/api/events", json=big, headers=headers).status_code == 413
    assert client.post("/api/events", json=small, headers=headers).status_code == 201


def test_idempotency_ttl_and_lease_from_the_environment(make_app, monkeypatch):
    monkeypatch.setenv("WEBHOOK_RECEIVER_IDEMPOTENCY_TTL_SECONDS", "120")
    monkeypatch.setenv("WEBHOOK_RECEIVER_IDEMPOTENCY_LEASE_SECONDS", "7")
    app = make_app()
    assert app.config["IDEMPOTENCY_TTL_SECONDS"] == 120
    response = app.test_client().post(
        "/api/events",
        json={"type": "t", "data": 1},
        headers={**bearer(), "Idempotency-Key": "ttl"},
    )
    assert response.status_code == 201
    with app.app_context():
        record = db.session.execute(select(IdempotencyRecord)).scalar_one()
        assert record.expires_at - record.created_at == timedelta(seconds=120)


def test_in_flight_retry_after_follows_the_configured_lease(make_app, monkeypatch):
    monkeypatch.setenv("WEBHOOK_RECEIVER_IDEMPOTENCY_LEASE_SECONDS", "7")
    app = make_app()
    with app.test_request_context():
        now = utcnow()
        outcome = records.claim(
            records.Request("acme", "held", "f" * 64, "POST", "/api/events"),
            now,
            timedelta(seconds=int(app.config["IDEMPOTENCY_LEASE_SECONDS"])),
            timedelta(hours=1),
        )
        assert isinstance(outcome, records.Claimed)
        db.session.remove()
    response = app.test_client().post(
        "/api/events",
        json={"type": "t", "data": 1},
        headers={**bearer(), "Idempotency-Key": "held"},
    )
    assert response.status_code == 409
    assert 1 <= int(response.headers["Retry-After"]) <= 7


def test_environment_settings_are_overridden_by_test_config(make_app, monkeypatch):
    monkeypatch.setenv("WEBHOOK_RECEIVER_MAX_BODY_BYTES", "2048")
    app = make_app(MAX_BODY_BYTES=4096)
    assert app.config["MAX_CONTENT_LENGTH"] == 4096


def test_trusted_proxies_set_the_client_address(make_app):
    """Behind one proxy, X-Forwarded-For is the client address (throttling depends on it)."""
    from flask import request

    seen = []
    app = make_app(TRUSTED_PROXIES=1)

    @app.get("/whoami-test")
    def whoami():
        seen.append(request.remote_addr)
        return "ok"

    app.test_client().get("/whoami-test", headers={"X-Forwarded-For": "203.0.113.9"})
    plain = make_app()
    plain.add_url_rule("/whoami-test", view_func=whoami)
    plain.test_client().get("/whoami-test", headers={"X-Forwarded-For": "203.0.113.9"})
    assert seen == ["203.0.113.9", "127.0.0.1"]


def test_transaction_pooler_turns_off_prepared_statements():
    """Behind pgbouncer in transaction mode psycopg must not prepare statements."""
    from webhook_receiver.database import engine_options

    url = "postgresql+psycopg://u@h/db"
    assert "prepare_threshold" not in engine_options(url)["connect_args"]
    assert engine_options(url, transaction_pooler=True)["connect_args"] == {
        "connect_timeout": 5,
        "prepare_threshold": None,
    }


def test_transaction_pooler_setting_reaches_the_engine(monkeypatch):
    from webhook_receiver import create_app

    monkeypatch.setenv("WEBHOOK_RECEIVER_TRANSACTION_POOLER", "true")
    app = create_app(
        {
            "TESTING": True,
            "SQLALCHEMY_DATABASE_URI": "postgresql://u@127.0.0.1:1/db",
            "RECEIVER_CONFIG": {},
        }
    )
    options = app.config["SQLALCHEMY_ENGINE_OPTIONS"]
    assert options["connect_args"]["prepare_threshold"] is None


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("MAX_BODY_BYTES", "abc", "WEBHOOK_RECEIVER_MAX_BODY_BYTES must be an integer, got 'abc'"),
        ("WORKER_POLL_SECONDS", "soon", "WEBHOOK_RECEIVER_WORKER_POLL_SECONDS must be a number"),
        ("PURGE_BATCH_SIZE", "0", "WEBHOOK_RECEIVER_PURGE_BATCH_SIZE must be at least 1"),
    ],
)
def test_bad_numeric_settings_name_the_setting(monkeypatch, name, value, message):
    from webhook_receiver import create_app
    from webhook_receiver.config import ConfigError

    monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", value)
    with pytest.raises(ConfigError, match=message):
        create_app({"TESTING": True, "RECEIVER_CONFIG": {}})


def test_api_retention_must_outlive_idempotency_keys():
    from webhook_receiver import create_app
    from webhook_receiver.config import ConfigError

    with pytest.raises(ConfigError, match="API events must outlive their keys"):
        create_app(
            {
                "TESTING": True,
                "RECEIVER_CONFIG": {},
                "API_RETENTION_DAYS": 1,
                "IDEMPOTENCY_TTL_SECONDS": 2 * 86400,
            }
        )


def test_the_example_config_works_as_documented(make_app):
    """docs/config.example.toml parses, and its demo source takes the documented delivery."""
    import hashlib
    import hmac
    import tomllib
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "docs" / "config.example.toml"
    app = make_app(tomllib.loads(path.read_text()))
    body = b'{"id": "evt-1", "type": "demo"}'
    sig = hmac.new(b"demo-secret-change-me", body, hashlib.sha256).hexdigest()
    headers = {"Content-Type": "application/json", "X-Signature": f"sha256={sig}"}
    response = app.test_client().post("/webhooks/demo", data=body, headers=headers)
    assert response.status_code == 200, response.get_data()
    assert response.get_json()["status"] == "accepted"
