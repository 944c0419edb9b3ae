"""PostgreSQL stopped under a load of signed webhooks: 503 while down, nothing lost after."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import requests

from ..servers import gunicorn, wait_until
from .load import CONFIG, Attempt, Journal, deliver, stored
from .postgres import wait_ready

CLIENTS = 6
PACE_SECONDS = 0.01  # between one client's deliveries, to bound the number of keys
WARM_SECONDS = 1.5
DOWN_SECONDS = 2.0
STEADY_SECONDS = 1.0
# A worker may find a dead pooled connection on its first request after the
# restart; past this, every answer must be a 2xx again.
RECOVERY_GRACE_SECONDS = 0.5


@dataclass(frozen=True)
class Outage:
    mode: str
    stopping: float  # pg_ctl stop called
    down_from: float  # pg_ctl stop returned: the server is gone
    down_until: float  # pg_ctl start about to be called
    up_at: float  # pg_ctl start returned
    recovered_at: float  # the first delivery sent after the restart that got a 2xx
    steady_until: float

    def strictly_down(self, attempt: Attempt) -> bool:
        """Sent and answered while no server was running at all."""
        return attempt.sent >= self.down_from and attempt.answered <= self.down_until


def first_ok_after(journal: Journal, moment: float) -> Attempt | None:
    """The earliest-sent delivery sent at or after ``moment`` that got a 2xx."""
    ok = [a for a in journal.snapshot() if a.ok and a.sent >= moment]
    return min(ok, key=lambda a: a.sent, default=None)


@pytest.mark.slow
def test_postgresql_stopped_mid_load_answers_503_and_loses_nothing(stoppable_postgres, tmp_path):
    pg = stoppable_postgres
    journal = Journal()
    done = threading.Event()
    serial = itertools.count()

    def client(n: int) -> None:
        with requests.Session() as session:
            while not done.is_set():
                journal.add(deliver(session, url, f"evt_{n}_{next(serial)}"))
                time.sleep(PACE_SECONDS)

    outages: list[Outage] = []
    with gunicorn(pg.url, CONFIG, tmp_path, workers=2) as server:
        url = server.url
        threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(WARM_SECONDS)
            # A crash first (no checkpoint, backends killed mid-transaction),
            # then a clean shutdown that disconnects clients.
            for mode in ("immediate", "fast"):
                stopping = time.monotonic()
                pg.stop(mode)
                down_from = time.monotonic()
                time.sleep(DOWN_SECONDS)
                down_until = time.monotonic()
                pg.start()
                up_at = time.monotonic()

                assert wait_until(lambda t=up_at: first_ok_after(journal, t), timeout=30), (
                    f"no 2xx within 30 s of PostgreSQL's restart\n{server.log()[-3000:]}"
                )
                recovered_at = first_ok_after(journal, up_at).sent  # type: ignore[union-attr]
                time.sleep(STEADY_SECONDS)
                outages.append(
                    Outage(
                        mode,
                        stopping,
                        down_from,
                        down_until,
                        up_at,
                        recovered_at,
                        time.monotonic(),
                    )
                )
        finally:
            done.set()
            for thread in threads:
                thread.join(timeout=60)
        log = server.log()
        attempts = journal.snapshot()
        statuses = journal.statuses()

        # The app answered every request, with a 2xx or a 503 that says why.
        assert set(statuses) <= {200, 503}, (statuses, log[-3000:])
        for attempt in attempts:
            if attempt.status == 503:
                assert attempt.problem == "/problems/database-unavailable", attempt
        for outage in outages:
            down = [a for a in attempts if outage.strictly_down(a)]
            assert len(down) >= 20, f"too few deliveries during the {outage.mode} outage"
            assert {a.status for a in down} == {503}, outage
            after = [
                a
                for a in attempts
                if outage.recovered_at + RECOVERY_GRACE_SECONDS <= a.sent
                and a.answered <= outage.steady_until
            ]
            assert after, outage
            assert all(a.ok for a in after), [a for a in after if not a.ok]
        before_first = [a for a in attempts if a.answered <= outages[0].stopping]
        assert before_first and all(a.ok for a in before_first)

        # Every acknowledged delivery is stored exactly once, under the id it was given.
        sent = journal.by_key()
        assert all(len(tries) == 1 for tries in sent.values())
        acked = {key: tries[0] for key, tries in sent.items() if tries[0].ok}
        held = stored(pg.url)
        for key, attempt in acked.items():
            assert held[key].rows == 1, key
            assert held[key].event_id == attempt.event_id, key
            assert held[key].duplicate_count == 0, key
        assert set(held) <= set(sent), "an event was stored that nobody sent"
        # A 503 may still have committed, if the server died between COMMIT and
        # its acknowledgement; never one sent once the server was down.
        committed_unacked = set(held) - set(acked)
        for key in committed_unacked:
            attempt = sent[key][0]
            assert not any(o.strictly_down(attempt) for o in outages), attempt
            assert any(attempt.sent <= o.down_from for o in outages), attempt

        # The providers retry what was not acknowledged, after recovery.
        assert wait_ready(pg.url)
        unacked = [key for key in sent if key not in acked]
        assert unacked, "the outages refused nothing"

        def resend(key: str) -> Attempt:
            with requests.Session() as session:
                return deliver(session, url, key)

        with ThreadPoolExecutor(4) as pool:
            retried = {a.key: a for a in pool.map(resend, unacked)}
        assert all(a.ok for a in retried.values()), [a for a in retried.values() if not a.ok]

    held = stored(pg.url)
    assert set(held) == set(sent), "every delivery is stored once the retries are in"
    assert all(entry.rows == 1 for entry in held.values())
    for key, attempt in retried.items():
        # The retry of a delivery that had committed is counted as its duplicate.
        assert attempt.replayed == (key in committed_unacked), key
        assert held[key].event_id == attempt.event_id
    for key, entry in held.items():
        replays = int(retried[key].replayed) if key in retried else 0
        assert entry.duplicate_count == replays, key
    print(
        f"\n{len(attempts)} deliveries, {statuses}; {len(unacked)} retried after recovery, "
        f"{len(committed_unacked)} of them had committed before their 503; "
        + ", ".join(
            f"{o.mode}: 2xx again {o.recovered_at - o.up_at:.2f} s after start" for o in outages
        )
    )
