"""The benchmark's bare baseline app runs against the real schema.

Its views send hand-written SQL into the receiver's tables: a schema change
that breaks them would otherwise show only as errors in a benchmark's
table, with its ratios measured against a baseline that did nothing.
"""

from __future__ import annotations

import importlib
import uuid

from flask.testing import FlaskClient
from sqlalchemy import create_engine, text


def test_the_baseline_views_store_into_the_current_schema(db_url, monkeypatch):
    monkeypatch.setenv("BENCH_DATABASE_URL", db_url)
    # Imported here: the module builds an app from the environment at import, for gunicorn.
    app = importlib.import_module("bench.baseline_app").create_app()
    try:
        _store_through(app.test_client(), db_url)
    finally:
        app.extensions["engine"].dispose()


def _store_through(client: FlaskClient, db_url: str) -> None:
    keys = [uuid.uuid4().hex for _ in range(2)]
    body = b'{"type": "bench", "data": 1}'
    baseline = client.post("/baseline", data=body, headers={"Idempotency-Key": keys[0]})
    floor = client.post("/floor/api-unique", data=body, headers={"Idempotency-Key": keys[1]})
    assert (baseline.status_code, floor.status_code) == (201, 201)
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            stored = conn.execute(
                text("SELECT dedup_key FROM events WHERE source = 'bench:baseline'")
            ).scalars()
            assert set(stored) == set(keys)
            records = conn.execute(
                text("SELECT count(*) FROM idempotency_records WHERE key = :key"),
                {"key": keys[1]},
            ).scalar_one()
            assert records == 1
    finally:
        engine.dispose()
