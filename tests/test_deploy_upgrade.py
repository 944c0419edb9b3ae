"""`flask db upgrade` on a database that holds data: every row of every older revision survives.

The other migration tests upgrade an empty database. A live deployment
upgrades one with rows in every table, written at whatever revision it
was on: here each table present at a revision gets rows (every column
filled, foreign keys pointing at real rows), the database is upgraded, and
every row must come out with the same values in the columns it still has,
and load through the models.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from alembic.script import ScriptDirectory
from flask import Flask
from flask_migrate import upgrade
from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import Connection

from webhook_receiver import create_app
from webhook_receiver.extensions import db

from .conftest import CLIENTS, SECRET_KEY
from .databases import throwaway_postgresql
from .test_migrations import current_revision, schema_diff

Rows = dict[str, dict[Any, dict[str, Any]]]


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_app(request: pytest.FixtureRequest, tmp_path) -> Iterator[Flask]:
    if request.param == "sqlite":
        yield from _app(f"sqlite:///{tmp_path / 'upgrade.sqlite3'}")
        return
    with throwaway_postgresql("wr_upgrade") as (url, _admin, _name):
        yield from _app(url)


def _app(url: str) -> Iterator[Flask]:
    app = create_app(
        {
            "TESTING": True,
            "SECRET_KEY": SECRET_KEY,
            "SQLALCHEMY_DATABASE_URI": url,
            "RECEIVER_CONFIG": {"clients": CLIENTS},
        }
    )
    yield app
    with app.app_context():
        db.session.remove()
        db.engine.dispose()


def revisions(app: Flask) -> list[str]:
    """Every revision, oldest first."""
    config = app.extensions["migrate"].migrate.get_config()
    script = ScriptDirectory.from_config(config)
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def _value(table: Table, column: Any, n: int) -> Any:
    """A value for ``column`` of row ``n``: distinct per row, so unique constraints hold."""
    if column.primary_key:
        return n
    if column.foreign_keys:
        return n  # the parent table's row n, written first
    kind = column.type
    if isinstance(kind, Boolean):
        return n % 2 == 0
    if isinstance(kind, Integer):
        return 10 * n + 1
    if isinstance(kind, Float):
        return n + 0.5
    if isinstance(kind, DateTime):
        return datetime(2026, 11, 1 + n, 10, n, n, 1000 * n)
    if isinstance(kind, LargeBinary):
        return f"body {n} of {table.name}".encode()
    if isinstance(kind, JSON) or "JSON" in type(kind).__name__.upper():
        return {"n": n, "of": table.name}
    if isinstance(kind, (String, Text)):
        text = f"{column.name}-{n}"
        length = getattr(kind, "length", None)
        return text[-length:] if length else text
    raise AssertionError(f"no value for {table.name}.{column.name} ({kind!r})")


def fill(conn: Connection, first: int, count: int = 2) -> Rows:
    """Write rows ``first`` .. into every table there is; the rows written, by table and id."""
    metadata = MetaData()
    metadata.reflect(conn)
    written: Rows = {}
    for table in metadata.sorted_tables:  # parents before the rows pointing at them
        if table.name == "alembic_version":
            continue
        rows = [
            {column.name: _value(table, column, n) for column in table.columns}
            for n in range(first, first + count)
        ]
        conn.execute(table.insert(), rows)
        written[table.name] = {row["id"]: row for row in rows}
    if conn.dialect.name == "postgresql":
        # The sequences must not hand out the ids written here.
        for table in written:
            conn.exec_driver_sql(
                f"SELECT setval(pg_get_serial_sequence('{table}', 'id'),"
                f" (SELECT max(id) FROM {table}))"
            )
    return written


def read(conn: Connection) -> Rows:
    metadata = MetaData()
    metadata.reflect(conn)
    return {
        table.name: {row["id"]: dict(row) for row in conn.execute(select(table)).mappings()}
        for table in metadata.sorted_tables
        if table.name != "alembic_version"
    }


def _comparable(value: Any) -> Any:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, memoryview):
        return bytes(value)
    return value


def assert_kept(written: Rows, now: Rows) -> None:
    """Every row written is there, with the same values in every column it still has."""
    for table, rows in written.items():
        assert table in now, f"table {table} is gone"
        for row_id, row in rows.items():
            assert row_id in now[table], f"{table} row {row_id} is gone"
            kept = now[table][row_id]
            for column, value in row.items():
                if column in kept:
                    assert _comparable(kept[column]) == _comparable(value), (table, row_id, column)


def load_every_model(written: Rows) -> None:
    """The models read every row written back (types, JSON, timestamps)."""
    for mapper in db.Model.registry.mappers:
        table = getattr(mapper.class_, "__tablename__", None)
        if table in written:
            ids = {row.id for row in db.session.scalars(select(mapper.class_))}
            assert ids >= set(written[table]), table
    db.session.remove()


def test_upgrade_from_0001_keeps_every_row_of_every_table(empty_app):
    runner = empty_app.test_cli_runner()
    with empty_app.app_context():
        upgrade(revision="0001")
        with db.engine.begin() as conn:
            written = fill(conn, first=1)
        assert set(written) == set(inspect(db.engine).get_table_names()) - {"alembic_version"}
        db.engine.dispose()

    result = runner.invoke(args=["db", "upgrade"])
    assert result.exit_code == 0, result.output

    with empty_app.app_context():
        assert current_revision() == revisions(empty_app)[-1]
        assert schema_diff() == []
        with db.engine.connect() as conn:
            assert_kept(written, read(conn))
        load_every_model(written)
        db.engine.dispose()


def test_upgrade_one_revision_at_a_time_keeps_the_rows_of_each(empty_app):
    # Rows written at every revision, in every table it has, then one step up.
    written: Rows = {}
    with empty_app.app_context():
        for step, revision in enumerate(revisions(empty_app)):
            upgrade(revision=revision)
            with db.engine.connect() as conn:
                assert_kept(written, read(conn))
            with db.engine.begin() as conn:
                for table, rows in fill(conn, first=1 + 2 * step).items():
                    written.setdefault(table, {}).update(rows)
        assert schema_diff() == []
        load_every_model(written)
        db.engine.dispose()


def test_a_revision_that_fails_leaves_the_database_as_it_was(empty_app):
    # docs/deployment.md: the upgrade is one transaction on both databases.
    with empty_app.app_context():
        upgrade(revision="0004")
        with db.engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE delivery_targets (id INTEGER PRIMARY KEY)")
        with pytest.raises(Exception, match="delivery_targets"):
            upgrade()  # 0005 and 0006 apply, then 0007 cannot create its table
        db.session.remove()
        db.engine.dispose()
        assert current_revision() == "0004"
        tables = set(inspect(db.engine).get_table_names())
        assert not tables & {"broker_positions", "replays", "delivery_attempts"}
        assert "replay_id" not in {c["name"] for c in inspect(db.engine).get_columns("deliveries")}
        db.engine.dispose()


def test_0003_counts_refusals_that_share_a_time_instead_of_failing(empty_app):
    # Before 0003 each refusal was a row stamped with utcnow(): two web
    # processes refusing one sender's flood wrote rows with the same source,
    # reason, address and microsecond, which 0003's unique constraint refuses.
    at = "2026-12-02 10:00:00.123456"
    rows = [("s", "bad-signature", "203.0.113.9", at)] * 3 + [
        ("s", "bad-signature", "203.0.113.9", "2026-12-02 10:00:01"),
        ("s", "bad-signature", None, at),
        ("s", "bad-signature", None, at),
    ]
    with empty_app.app_context():
        upgrade(revision="0002")
        with db.engine.begin() as conn:
            for source, reason, address, received_at in rows:
                conn.execute(
                    text(
                        "INSERT INTO rejections (source, reason, detail, remote_addr, received_at)"
                        " VALUES (:source, :reason, 'd', :address, :at)"
                    ),
                    {"source": source, "reason": reason, "address": address, "at": received_at},
                )
        upgrade()
        with db.engine.connect() as conn:
            kept = conn.execute(
                text(
                    "SELECT remote_addr, seen_count FROM rejections"
                    " ORDER BY remote_addr NULLS LAST, received_at, id"
                )
            ).all()
        # Every refusal still counted: the three that shared a time are one row of 3.
        assert [tuple(row) for row in kept] == [
            ("203.0.113.9", 3),
            ("203.0.113.9", 1),
            (None, 1),
            (None, 1),
        ]
        assert schema_diff() == []
        db.engine.dispose()
