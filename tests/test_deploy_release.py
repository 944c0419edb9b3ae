"""Two `flask db upgrade` at once (two deploys' release steps, or a release run on every dyno).

Both must succeed and the schema be applied once. Another connection holds
a lock the next revision needs, so that both upgrades have read the
database's revision and wait to apply the same one when it is let go.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from .databases import throwaway_postgresql
from .servers import ROOT, wait_until

FLASK = str(ROOT / ".venv" / "bin" / "flask")


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(DATABASE_URL for the CLI, the SQLAlchemy URL) of an empty database of this test's own."""
    if request.param == "sqlite":
        path = tmp_path / "release.sqlite3"
        yield f"sqlite:///{path}", f"sqlite:///{path}"
        return
    with throwaway_postgresql("wr_release") as (url, _admin, _name):
        yield url.replace("postgresql+psycopg://", "postgresql://"), url


def flask(
    database_url: str, *args: str, stdout=subprocess.PIPE, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    environment = {
        k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "WEBHOOK_RECEIVER_"))
    }
    environment.update(env or {}, DATABASE_URL=database_url)
    return subprocess.Popen(
        [FLASK, "--app", "wsgi", *args],
        cwd=ROOT,
        env=environment,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
    )


def lock_sqlite(sa_url: str) -> Callable[[], None]:
    """Hold the write lock every upgrade needs, until the function returned is called."""
    blocker = sqlite3.connect(sa_url.removeprefix("sqlite:///"), isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")

    def release() -> None:
        blocker.rollback()
        blocker.close()

    return release


def lock_entity_versions(sa_url: str) -> Callable[[], None]:
    """Hold a lock on the table 0010 indexes, until the function returned is called."""
    engine = create_engine(sa_url)
    holder = engine.connect()
    holder.execute(text("LOCK TABLE entity_versions IN ACCESS EXCLUSIVE MODE"))

    def release() -> None:
        holder.close()
        engine.dispose()

    return release


def test_two_release_steps_at_once_both_succeed_and_migrate_once(database, tmp_path):
    cli_url, sa_url = database
    first = flask(cli_url, "db", "upgrade", "0009")
    output = first.communicate(timeout=120)[0]
    assert first.returncode == 0, output

    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    if sa_url.startswith("sqlite"):
        release = lock_sqlite(sa_url)
    else:
        release = lock_entity_versions(sa_url)
    try:
        upgrades = []
        for log in logs:
            with open(log, "w") as out:
                upgrades.append(flask(cli_url, "db", "upgrade", stdout=out))
        # Both have started and read the revision (alembic says which impl it uses).
        assert wait_until(
            lambda: all("Context impl" in log.read_text() for log in logs), timeout=60
        ), [log.read_text() for log in logs]
        time.sleep(2)
    finally:
        release()
    statuses = [upgrade.wait(timeout=120) for upgrade in upgrades]
    assert statuses == [0, 0], [log.read_text()[-2000:] for log in logs]
    # 0010 ran once.
    assert sum(log.read_text().count("Running upgrade 0009 -> 0010") for log in logs) == 1

    engine = create_engine(sa_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0011"
    engine.dispose()


def test_an_upgrade_outlasting_the_apps_timeouts_runs_to_its_end(database, tmp_path):
    # The app's PostgreSQL connections cancel a statement after
    # DATABASE_STATEMENT_TIMEOUT_SECONDS (30 s by default), meant for
    # requests: an index built on a big table, or a wait behind another
    # upgrade, outlasts it. SQLite's busy timeout (10 s) likewise.
    cli_url, sa_url = database
    first = flask(cli_url, "db", "upgrade", "0009")
    output = first.communicate(timeout=120)[0]
    assert first.returncode == 0, output

    if sa_url.startswith("sqlite"):
        release, held = lock_sqlite(sa_url), 12.0
    else:
        release, held = lock_entity_versions(sa_url), 4.0
    log = tmp_path / "upgrade.log"
    try:
        with open(log, "w") as out:
            upgrade = flask(
                cli_url,
                "db",
                "upgrade",
                stdout=out,
                env={"WEBHOOK_RECEIVER_DATABASE_STATEMENT_TIMEOUT_SECONDS": "1"},
            )
        assert wait_until(lambda: "Context impl" in log.read_text(), timeout=60), log.read_text()
        time.sleep(held)
    finally:
        release()
    assert upgrade.wait(timeout=120) == 0, log.read_text()[-2000:]
    assert "Running upgrade 0009 -> 0010" in log.read_text()
