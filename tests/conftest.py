"""Fixtures: an app on a fresh, migrated database per test, on SQLite and PostgreSQL.

Every database test is parametrised over both engines through the ``db_url``
fixture. PostgreSQL runs when ``TEST_DATABASE_URL`` is set; in CI (``CI`` set)
it must be, and a skipped PostgreSQL test fails the run.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient, FlaskCliRunner
from sqlalchemy import create_engine, text

from webhook_receiver import create_app
from webhook_receiver.extensions import db as _db
from webhook_receiver.inbox import duplicates

from .databases import PG_URL, throwaway_postgresql

CI = bool(os.environ.get("CI"))

ACME_TOKEN = "acme-token-0123456789abcdef"
GLOBEX_TOKEN = "globex-token-0123456789abcdef"
CLIENTS = {"acme": {"token": ACME_TOKEN}, "globex": {"token": GLOBEX_TOKEN}}
SECRET_KEY = "test-secret-key-0123456789abcdef"

_skipped_pg: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    if CI and not PG_URL:
        raise pytest.UsageError("CI is set but TEST_DATABASE_URL is not: PostgreSQL must run")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "postgresql" in report.nodeid:
        _skipped_pg.append(report.nodeid)


NO_POSTGRESQL = "skipped without PostgreSQL"


def _skipped_for_want_of_postgresql(report: pytest.TestReport) -> bool:
    return (
        report.skipped
        and isinstance(report.longrepr, tuple)
        and "TEST_DATABASE_URL is not set" in str(report.longrepr[2])
    )


def pytest_report_teststatus(
    report: pytest.TestReport, config: pytest.Config
) -> tuple[str, str, str] | None:
    # Their own category: -ra lists the other skips one by one, these are one count.
    if _skipped_for_want_of_postgresql(report):
        return NO_POSTGRESQL, "s", "SKIPPED"
    return None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    skipped = len(terminalreporter.stats.get(NO_POSTGRESQL, []))
    if skipped:
        terminalreporter.write_line(
            f"{skipped} PostgreSQL test(s) skipped: TEST_DATABASE_URL is not set "
            "(for example postgresql://postgres@127.0.0.1:5432/test)"
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if CI and _skipped_pg:
        print(f"\nFAILED: {len(_skipped_pg)} PostgreSQL test(s) skipped in CI:")
        for nodeid in _skipped_pg:
            print(f"  {nodeid}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the developer's environment out of the tests."""
    for name in list(os.environ):
        if name.startswith(("FLASK_", "WEBHOOK_RECEIVER_")) or name in (
            "DATABASE_URL",
            "SECRET_KEY",
        ):
            monkeypatch.delenv(name, raising=False)


def _migrate(uri: str) -> None:
    from flask_migrate import upgrade

    app = create_app({"TESTING": True, "SQLALCHEMY_DATABASE_URI": uri, "RECEIVER_CONFIG": {}})
    with app.app_context():
        upgrade()
        _db.engine.dispose()


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("sqlite") / "template.sqlite3"
    _migrate(f"sqlite:///{path}")
    # Fold the WAL into the main file so that a plain copy is complete.
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode=DELETE")
    return str(path)


@pytest.fixture(scope="session")
def _pg_database() -> Iterator[str]:
    """A PostgreSQL database of this test run's own, migrated once."""
    with throwaway_postgresql(f"wr_test_{os.getpid()}") as (url, _admin, _name):
        _migrate(url)
        yield url


def _truncate_all(url: str) -> None:
    engine = create_engine(url)
    tables = ", ".join(f'"{t.name}"' for t in _db.metadata.sorted_tables)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """The SQLAlchemy URL of an empty, migrated database for this test alone."""
    if request.param == "sqlite":
        template = request.getfixturevalue("_sqlite_template")
        path = tmp_path / "test.sqlite3"
        shutil.copyfile(template, path)
        yield f"sqlite:///{path}"
        return
    url = request.getfixturevalue("_pg_database")
    try:
        yield url
    finally:
        _truncate_all(url)


@pytest.fixture
def make_app(db_url: str, tmp_path: Any) -> Iterator[Callable[..., Flask]]:
    """Build apps on this test's database; keyword arguments override the config."""
    apps: list[Flask] = []

    def factory(receiver_config: dict[str, Any] | None = None, **overrides: Any) -> Flask:
        config: dict[str, Any] = {
            "TESTING": True,
            "SECRET_KEY": SECRET_KEY,
            "SQLALCHEMY_DATABASE_URI": db_url,
            # Each redelivery's count is written before its answer, so a test
            # reads it at once; tests of the batches (and every gunicorn
            # test) run the default.
            "DUPLICATE_FLUSH_SECONDS": 0,
            "REJECTION_FLUSH_SECONDS": 0,
            "RECEIVER_CONFIG": receiver_config
            if receiver_config is not None
            else {"clients": CLIENTS},
        }
        config.update(overrides)
        app = create_app(config)
        apps.append(app)
        return app

    yield factory
    for app in apps:
        # No batch of this test may land in the next one's database.
        app.extensions[duplicates.EXTENSION].close()
        with app.app_context():
            _db.session.remove()
            _db.engine.dispose()


@pytest.fixture
def app(make_app: Callable[..., Flask]) -> Flask:
    """The app with the default test clients, on this test's database."""
    return make_app()


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture
def runner(app: Flask) -> FlaskCliRunner:
    return app.test_cli_runner()


def bearer(token: str = ACME_TOKEN) -> dict[str, str]:
    """Headers that authenticate as a test client."""
    return {"Authorization": f"Bearer {token}"}
