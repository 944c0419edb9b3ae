"""SQLite write-locked by another process under a load of signed webhooks: 503, never a 2xx."""

from __future__ import annotations

import itertools
import shutil
import sqlite3
import threading
import time

import pytest
import requests

from ..servers import gunicorn
from .load import CONFIG, Journal, deliver, stored

CLIENTS = 4
WORKERS = 4
# Past the app's busy timeout (database.SQLITE_BUSY_TIMEOUT_MS, 10 s), so
# that the deliveries that arrive first give up while the lock is still held.
LOCK_SECONDS = 12.0


@pytest.mark.slow
def test_sqlite_write_locked_mid_load_answers_503_and_loses_nothing(_sqlite_template, tmp_path):
    path = tmp_path / "locked.sqlite3"
    shutil.copyfile(_sqlite_template, path)
    db_url = f"sqlite:///{path}"
    journal = Journal()
    done = threading.Event()
    serial = itertools.count()

    def client(n: int) -> None:
        with requests.Session() as session:
            while not done.is_set():
                journal.add(deliver(session, url, f"evt_{n}_{next(serial)}"))
                time.sleep(0.02)

    with gunicorn(db_url, CONFIG, tmp_path, workers=WORKERS) as server:
        url = server.url
        threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
        for thread in threads:
            thread.start()
        # Another process (a backup, a migration, a stuck script) holds the
        # write lock; readers go on in WAL mode, writers wait, then give up.
        holder = sqlite3.connect(path, isolation_level=None, timeout=30)
        try:
            time.sleep(1.0)
            holder.execute("BEGIN IMMEDIATE")
            locked_from = time.monotonic()
            time.sleep(LOCK_SECONDS)
            locked_until = time.monotonic()
            holder.execute("ROLLBACK")
            time.sleep(1.5)
            recovered = time.monotonic()
            time.sleep(1.0)
        finally:
            holder.close()
            done.set()
            for thread in threads:
                thread.join(timeout=60)
        log = server.log()
        attempts = journal.snapshot()

        assert {a.status for a in attempts} <= {200, 503}, (journal.statuses(), log[-3000:])
        # Once BEGIN IMMEDIATE returned no delivery held the write lock, so
        # every answer given while it was held (past the time to send one that
        # had committed just before) is a refusal.
        locked = [a for a in attempts if locked_from + 0.2 <= a.answered <= locked_until]
        # Writers queue for their turn (database.writer_turn), each wait
        # bounded by the busy timeout: the first gives up on SQLite's lock,
        # the others on the turn, except one whose turn comes before its
        # deadline and which then outlasts the lock.
        assert len(locked) >= 2, "too few deliveries gave up during the lock"
        assert {a.status for a in locked} == {503}
        assert {a.problem for a in locked} == {"/problems/database-unavailable"}
        assert all(a.ok for a in attempts if a.sent >= recovered)
        assert all(a.ok for a in attempts if a.answered < locked_from)

        sent = journal.by_key()
        held = stored(db_url)
        acked = {key for key, tries in sent.items() if tries[0].ok}
        # SQLite gives up before its commit, so a 503 here never stored anything.
        assert set(held) == acked
        assert all(entry.rows == 1 and entry.duplicate_count == 0 for entry in held.values())
        with requests.Session() as session:
            retried = [deliver(session, url, key) for key in sent if key not in acked]
    assert retried and all(a.ok and not a.replayed for a in retried)
    held = stored(db_url)
    assert set(held) == set(sent)
    assert all(entry.rows == 1 and entry.duplicate_count == 0 for entry in held.values())
