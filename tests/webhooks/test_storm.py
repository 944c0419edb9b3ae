"""A concurrent storm of one delivery through real gunicorn workers."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from sqlalchemy import create_engine, text

from ..helpers import signing as s
from ..servers import gunicorn

CONFIG = f"""
[sources.stripe-live]
provider = "stripe"
secrets = ["{s.STRIPE_SECRET}"]
"""

COPIES = 50


@pytest.mark.slow
def test_fifty_simultaneous_copies_store_one_event(db_url, tmp_path):
    workers = 4 if db_url.startswith("postgresql") else 2
    body, headers = s.stripe_delivery({"id": "evt_storm", "type": "invoice.paid", "data": {}})
    barrier = threading.Barrier(COPIES)

    def deliver(_: int) -> requests.Response:
        with requests.Session() as session:
            barrier.wait(timeout=30)
            return session.post(url, data=body, headers=headers, timeout=30)

    with gunicorn(db_url, CONFIG, tmp_path, workers=workers) as server:
        url = f"{server.url}/webhooks/stripe-live"
        with ThreadPoolExecutor(COPIES) as pool:
            responses = list(pool.map(deliver, range(COPIES)))
    statuses = [r.status_code for r in responses]
    assert statuses == [200] * COPIES, server.log()
    ids = {r.json()["event_id"] for r in responses}
    assert len(ids) == 1
    replayed = [r.headers.get("Idempotent-Replayed") for r in responses]
    assert replayed.count("true") == COPIES - 1
    engine = create_engine(db_url)
    with engine.connect() as conn:
        events = conn.execute(text("SELECT id FROM events")).all()
        duplicates = conn.execute(text("SELECT count(*) FROM event_duplicates")).scalar()
    engine.dispose()
    assert len(events) == 1
    assert duplicates == COPIES - 1
