"""The real migrations: they build what the models describe, on both databases, both ways."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from flask import Flask
from flask_migrate import downgrade, upgrade
from sqlalchemy import Column, Integer, MetaData, inspect, select

from webhook_receiver import create_app
from webhook_receiver.extensions import db
from webhook_receiver.models import Event

from .conftest import CLIENTS, SECRET_KEY, bearer
from .databases import throwaway_postgresql


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """An empty database of this test's own: downgrades must not touch the shared one."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'migrations.sqlite3'}"
        return
    with throwaway_postgresql("wr_migrations") as (url, _admin, _name):
        yield url


@pytest.fixture
def fresh_app(empty_url: str) -> Iterator[Flask]:
    app = create_app(
        {
            "TESTING": True,
            "SECRET_KEY": SECRET_KEY,
            "SQLALCHEMY_DATABASE_URI": empty_url,
            "RECEIVER_CONFIG": {"clients": CLIENTS},
        }
    )
    yield app
    with app.app_context():
        db.session.remove()
        db.engine.dispose()


def schema_diff(metadata: MetaData | None = None) -> list:
    """What autogenerate would write to make the database match ``metadata`` (the models)."""
    with db.engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "compare_server_default": True}
        )
        return compare_metadata(context, metadata if metadata is not None else db.metadata)


def app_tables() -> set[str]:
    return set(inspect(db.engine).get_table_names()) - {"alembic_version"}


def head_revision(app: Flask) -> str:
    config = app.extensions["migrate"].migrate.get_config()
    heads = ScriptDirectory.from_config(config).get_heads()
    assert len(heads) == 1, f"the migrations have more than one head: {heads}"
    return heads[0]


def current_revision() -> str | None:
    with db.engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def test_migrations_build_what_the_models_describe(fresh_app):
    with fresh_app.app_context():
        upgrade()
        assert current_revision() == head_revision(fresh_app)
        assert app_tables() == set(db.metadata.tables)
        assert schema_diff() == []


def test_flask_db_check_finds_nothing_to_migrate(fresh_app):
    runner = fresh_app.test_cli_runner()
    with fresh_app.app_context():
        upgrade()
    result = runner.invoke(args=["db", "check"])
    assert result.exit_code == 0, result.output
    assert result.exception is None


def test_the_comparison_does_see_a_model_the_migrations_lack(fresh_app):
    # The control: the check above would notice a model change without a migration.
    with fresh_app.app_context():
        upgrade()
        changed = MetaData(naming_convention=db.metadata.naming_convention)
        for table in db.metadata.tables.values():
            table.to_metadata(changed)
        changed.tables["events"].append_column(Column("priority", Integer))
        diff = schema_diff(changed)
    assert [(op[0], op[2], op[3].name) for op in diff] == [("add_column", "events", "priority")]


def test_downgrade_to_base_then_upgrade_again(fresh_app):
    client = fresh_app.test_client()
    headers = {**bearer(), "Idempotency-Key": "round-trip"}
    with fresh_app.app_context():
        upgrade()
        assert (
            client.post("/api/events", json={"type": "t", "data": 1}, headers=headers).status_code
            == 201
        )
        db.session.remove()

        downgrade(revision="base")
        assert app_tables() == set()
        assert current_revision() is None

        upgrade()
        assert current_revision() == head_revision(fresh_app)
        assert schema_diff() == []
        db.session.remove()
    # The rebuilt schema is empty and works: the same key executes afresh.
    response = client.post("/api/events", json={"type": "t", "data": 1}, headers=headers)
    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response.headers
    # The only event: the old one went with the schema. (On PostgreSQL its
    # id may come from ids the process reserved before the rebuild.)
    with fresh_app.app_context():
        assert list(db.session.scalars(select(Event.id))) == [response.get_json()["id"]]
        db.session.remove()


def test_0004_keeps_every_row_and_counts_duplicates_from_their_rows(fresh_app):
    # The upgrade drops two columns of events, which other tables point at
    # with ON DELETE CASCADE: a copy of the table (SQLite's batch mode)
    # would have deleted its deliveries, duplicates and conflicts.
    at = "2026-12-01 10:00:00"
    with fresh_app.app_context():
        upgrade(revision="0003")
        with db.engine.begin() as conn:
            for event_id, count in ((1, 2), (2, 0)):
                conn.exec_driver_sql(
                    "INSERT INTO events (id, source, dedup_key, fingerprint, body, headers, meta,"
                    " received_at, duplicate_count) VALUES"
                    f" ({event_id}, 's', 'k{event_id}', 'f', '', '[]', '{{}}', '{at}', {count})"
                )
            for minute in (1, 7):
                conn.exec_driver_sql(
                    "INSERT INTO event_duplicates (event_id, received_at)"
                    f" VALUES (1, '2026-12-01 10:0{minute}:00')"
                )
            conn.exec_driver_sql(
                "INSERT INTO deliveries (event_id, consumer, kind, state, attempts,"
                f" next_attempt_at, created_at, updated_at)"
                f" VALUES (1, 'c', 'http', 'pending', 0, '{at}', '{at}', '{at}')"
            )
        upgrade()
        assert schema_diff() == []
        counts = {
            event.id: (event.duplicate_count, event.last_duplicate_at)
            for event in db.session.scalars(select(Event))
        }
        assert counts[1][0] == 2 and counts[1][1].minute == 7
        assert counts[2] == (0, None)
        with db.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM deliveries").scalar() == 1
            assert conn.exec_driver_sql("SELECT count(*) FROM event_duplicates").scalar() == 2
        db.session.remove()

        downgrade(revision="0003")
        with db.engine.connect() as conn:
            rows = conn.exec_driver_sql(
                "SELECT id, duplicate_count, last_duplicate_at FROM events ORDER BY id"
            ).all()
        assert [(r[0], r[1], r[2] is not None) for r in rows] == [(1, 2, True), (2, 0, False)]
