"""Settings: the database URL and the SQLite defaults, the WEBHOOK_RECEIVER_* environment."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from webhook_receiver import config as cfg
from webhook_receiver import create_app
from webhook_receiver.extensions import db
from webhook_receiver.idempotency.persistence import records
from webhook_receiver.models import EventDuplicate, IdempotencyRecord, utcnow

from ..conftest import bearer
from .conftest import build, dispose, flask_consume_list

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


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("nonsense", "is not a database URL"),
        ("mysql://u:hunter2@db.example/app", "PostgreSQL (postgresql://"),
        ("postgresql+psycopg2://u:hunter2@db.example/app", "PostgreSQL (postgresql://"),
        ("sqlite+aiosqlite:////tmp/app.sqlite3", "PostgreSQL (postgresql://"),
    ],
)
def test_a_database_url_the_receiver_cannot_use_is_a_config_error_without_its_password(
    instance, monkeypatch, url, said
):
    with pytest.raises(cfg.ConfigError, match="DATABASE_URL") as raised:
        cfg.database_uri(url, "/unused")
    assert said in str(raised.value)
    assert "hunter2" not in str(raised.value)
    monkeypatch.setenv("DATABASE_URL", url)
    with pytest.raises(cfg.ConfigError, match="DATABASE_URL"):
        build(RECEIVER_CONFIG={})


def test_the_flask_cli_says_a_database_url_it_cannot_use_in_one_line(tmp_path):
    # Before, SQLAlchemy's ArgumentError (or NoSuchModuleError) ended the app
    # factory with a traceback, which the flask CLI showed as "No such command".
    done = flask_consume_list(DATABASE_URL="mysql://u:hunter2@db.example/app")
    assert done.returncode != 0
    assert "Error: DATABASE_URL" in done.stderr
    assert "Traceback" not in done.stderr and "hunter2" not in done.stderr + done.stdout


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
        # Below the range as above it: the whole range is named.
        ("PURGE_BATCH_SIZE", "0", "WEBHOOK_RECEIVER_PURGE_BATCH_SIZE must be from 1 to "),
        ("ADMIN_SESSION_HOURS", "0", r"ADMIN_SESSION_HOURS must be from 0.01 to 8,760 \(1 year"),
    ],
)
def test_bad_numeric_settings_name_the_setting(monkeypatch, name, value, message):
    from webhook_receiver.config import ConfigError

    monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", value)
    with pytest.raises(ConfigError, match=message):
        create_app({"TESTING": True, "RECEIVER_CONFIG": {}})
