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
from collections.abc import Iterator
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


def flask(database_url: str, *args: str, stdout=subprocess.PIPE) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "WEBHOOK_RECEIVER_"))}
    env["DATABASE_URL"] = database_url
    return subprocess.Popen(
        [FLASK, "--app", "wsgi", *args],
        cwd=ROOT,
        env=env,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_release_steps_at_once_both_succeed_and_migrate_once(database, tmp_path):
    cli_url, sa_url = database
    first = flask(cli_url, "db", "upgrade", "0009")
    output = first.communicate(timeout=120)[0]
    assert first.returncode == 0, output

    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    if sa_url.startswith("sqlite"):
        blocker = sqlite3.connect(sa_url.removeprefix("sqlite:///"), isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # the write lock every upgrade needs
        release = blocker.rollback
    else:
        engine = create_engine(sa_url)
        holder = engine.connect()
        holder.execute(text("LOCK TABLE entity_versions IN ACCESS EXCLUSIVE MODE"))
        release = holder.close
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
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0010"
    engine.dispose()
