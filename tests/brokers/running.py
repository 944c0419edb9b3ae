"""Real ``flask --app wsgi consume`` processes: their config, their end, their database."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from sqlalchemy import create_engine, text

from webhook_receiver.models import Event

from .conftest import stop


def toml(sources: dict[str, dict[str, Any]]) -> str:
    """A config file holding these source tables (string and integer values)."""
    lines = []
    for name, table in sources.items():
        lines.append(f"[sources.{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def terminate(process: subprocess.Popen[bytes], log_path: Any) -> int:
    """SIGTERM a consume process; its exit status (it must stop within 30 s)."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)  # every thread's stack into the log
        time.sleep(1)
        stop(process)
        raise AssertionError(f"consume did not stop on SIGTERM:\n{log_tail(log_path)}") from None


def log_tail(log_path: Any) -> str:
    """The end of a process's log, for an assertion's message."""
    return log_path.read_text(errors="replace")[-8000:]


def hold_writers(db_url: str) -> Callable[[], None]:
    """Make the app's writers wait (without failing) from outside; return a release function."""
    if db_url.startswith("sqlite"):
        # The writers' turn another process of the app holds (database.SQLiteWriterTurns):
        # a writer waits for it up to the busy timeout.
        fd = os.open(db_url.removeprefix("sqlite:///") + "-writers.lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)

        def release() -> None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

        return release
    engine = create_engine(db_url)
    conn = engine.connect()
    conn.execute(text(f"LOCK TABLE {Event.__tablename__} IN EXCLUSIVE MODE"))

    def release_pg() -> None:
        conn.rollback()
        conn.close()
        engine.dispose()

    return release_pg


def count_rows(url: str) -> int:
    """How many events the database at ``url`` holds (read from outside any app)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(f"SELECT count(*) FROM {Event.__tablename__}")).scalar_one()
    finally:
        engine.dispose()


def key_counts(url: str) -> Counter[str]:
    """How many events each dedup key has in the database at ``url``."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return Counter(
                conn.execute(text(f"SELECT dedup_key FROM {Event.__tablename__}")).scalars()
            )
    finally:
        engine.dispose()


def publish_in_background(
    publish: Callable[[list[Any]], None], messages: list[Any], chunk: int = 50
) -> threading.Thread:
    """Publish ``messages`` in chunks from a thread (started); join it to wait for the last."""

    def go() -> None:
        for i in range(0, len(messages), chunk):
            publish(messages[i : i + chunk])

    thread = threading.Thread(target=go)
    thread.start()
    return thread
