"""A storm of duplicates of many keys at once through four gunicorn workers."""

from __future__ import annotations

import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from ..servers import gunicorn
from .load import CONFIG, Attempt, deliver, stored

WORKERS = 4
KEYS = 10
COPIES = 30
CLIENTS = 50


@pytest.mark.slow
def test_storm_of_ten_keys_stores_one_event_each_with_exact_counts(db_url, tmp_path):
    keys = [f"evt_storm_{n}" for n in range(KEYS)]
    plan = [key for key in keys for _ in range(COPIES)]
    random.Random(6).shuffle(plan)  # interleaved: every worker sees every key
    barrier = threading.Barrier(CLIENTS)

    def client(n: int) -> list[Attempt]:
        with requests.Session() as session:
            barrier.wait(timeout=30)
            return [deliver(session, url, key) for key in plan[n::CLIENTS]]

    with gunicorn(db_url, CONFIG, tmp_path, workers=WORKERS) as server:
        url = server.url
        with ThreadPoolExecutor(CLIENTS) as pool:
            attempts = [a for batch in pool.map(client, range(CLIENTS)) for a in batch]
        log = server.log()

    statuses = Counter(a.status for a in attempts)
    assert statuses == {200: KEYS * COPIES}, (statuses, log[-3000:])
    held = stored(db_url)
    assert set(held) == set(keys)
    for key in keys:
        answers = [a for a in attempts if a.key == key]
        assert len(answers) == COPIES
        assert {a.event_id for a in answers} == {held[key].event_id}, key
        assert sum(not a.replayed for a in answers) == 1, key
        assert held[key].rows == 1, key
        assert held[key].duplicate_count == COPIES - 1, key
