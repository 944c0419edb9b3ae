"""gunicorn workers SIGKILLed under load: no acknowledged event lost, none stored twice."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from ..servers import gunicorn, wait_until, worker_pids
from .load import CONFIG, Attempt, Journal, deliver, stored

WORKERS = 3
CLIENTS = 6
KILLS = 6
KILL_INTERVAL_SECONDS = 0.6
REDELIVERY_SHARE = 0.25
MAX_TRIES = 40


# Serial: its kills must land on requests in flight, which the load of the
# parallel run can starve.
@pytest.mark.slow
@pytest.mark.serial
def test_sigkilled_workers_lose_no_acknowledged_event(db_url, tmp_path):
    journal = Journal()
    done = threading.Event()
    acked: list[str] = []

    def until_acked(session: requests.Session, key: str) -> Attempt:
        # As a provider does: a reset connection or a 5xx is retried, with backoff.
        for n in range(MAX_TRIES):
            attempt = journal.add(deliver(session, url, key, timeout=20))
            if attempt.ok:
                return attempt
            time.sleep(0.02 * min(n + 1, 10))
        raise AssertionError(f"{key} was never acknowledged in {MAX_TRIES} tries")

    def client(n: int) -> None:
        rng = random.Random(n)
        serial = 0
        with requests.Session() as session:
            while not done.is_set():
                if acked and rng.random() < REDELIVERY_SHARE:
                    until_acked(session, rng.choice(acked))  # a redelivery
                    continue
                key = f"evt_{n}_{serial}"
                serial += 1
                until_acked(session, key)
                acked.append(key)

    killed: list[int] = []
    with gunicorn(db_url, CONFIG, tmp_path, workers=WORKERS) as server:
        url = server.url
        master = server.process.pid
        assert wait_until(lambda: len(worker_pids(master)) == WORKERS)
        born = dict.fromkeys(worker_pids(master), time.monotonic())
        with ThreadPoolExecutor(CLIENTS) as pool:
            clients = [pool.submit(client, n) for n in range(CLIENTS)]
            try:
                for _ in range(KILLS):
                    time.sleep(KILL_INTERVAL_SECONDS)
                    # The oldest worker: a fresh one may still be loading the
                    # app, with no request of its own to cut off.
                    now = time.monotonic()
                    victim = min(worker_pids(master), key=lambda pid: born.setdefault(pid, now))
                    os.kill(victim, signal.SIGKILL)
                    killed.append(victim)
                    # The master notices and forks a replacement.
                    assert wait_until(
                        lambda v=victim: (
                            v not in (pids := worker_pids(master)) and len(pids) == WORKERS
                        ),
                        timeout=30,
                    ), server.log()[-3000:]
                    for pid in worker_pids(master):
                        born.setdefault(pid, time.monotonic())
                time.sleep(KILL_INTERVAL_SECONDS)
            finally:
                done.set()
            for future in clients:
                future.result(timeout=120)
        assert server.process.poll() is None, "the gunicorn master died"
        log = server.log()

    attempts = journal.snapshot()
    statuses = journal.statuses()
    # A killed worker's requests see their connection cut; nothing answers
    # with an error of the application's own.
    assert {a.status for a in attempts} <= {200, None}, (statuses, log[-3000:])
    assert any(a.status is None for a in attempts), "no kill landed on a request in flight"

    held = stored(db_url)
    sent = journal.by_key()
    assert set(held) == set(sent), "every acknowledged delivery is stored, and nothing else"
    for key, tries in sent.items():
        entry = held[key]
        assert entry.rows == 1, key  # never stored twice
        answered = [a for a in tries if a.ok]
        cut_off = [a for a in tries if not a.ok]
        # Every 2xx names the one stored event.
        assert {a.event_id for a in answered} == {entry.event_id}, key
        # At most one attempt inserted the event; if none was cut off, exactly
        # one was answered as the first receipt.
        firsts = [a for a in answered if not a.replayed]
        assert len(firsts) <= 1, key
        if not cut_off:
            assert len(firsts) == 1, key
        # Redeliveries are counted in batches (duplicates.py): a killed
        # worker loses the ones it had not written yet, so the count may fall
        # short of the answered copies, but it never counts a copy twice or
        # one nobody sent.
        assert entry.duplicate_count + 1 <= len(answered) + len(cut_off), key
    uncounted = sum(
        max(0, sum(a.ok for a in t) - 1 - held[k].duplicate_count) for k, t in sent.items()
    )
    print(
        f"\n{len(killed)} workers killed; {len(attempts)} attempts for {len(sent)} keys, "
        f"{statuses}; {uncounted} answered redeliveries lost uncounted with their worker"
    )
