"""PostgreSQL keeps a batch statement's plan only once the events table is large.

Planned for each batch, the statement cost the server a third of its time
on a batch of 200 (parsing and planning it again). Kept too early, its plan
could read the events table by a scan (the cheapest way while it holds a
few pages) and go on scanning it as it grows. So it is prepared once the
table passes PREPARED_FROM_BYTES, and never behind a transaction pooler.
SQLite prepares nothing on the server: these tests are PostgreSQL's.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from sqlalchemy import func, select, text

from webhook_receiver import inbox
from webhook_receiver.database import autocommit_connection
from webhook_receiver.extensions import db
from webhook_receiver.inbox.batch_rows import PREPARED_FROM_BYTES
from webhook_receiver.models import Event

from .test_positions import SOURCE, _config, at, message

_keys = itertools.count()
# More batches than psycopg's and PostgreSQL's own thresholds (a statement
# run five times is prepared, a prepared one planned five times is kept).
BATCHES = 7


@pytest.fixture
def pg_app(make_app, db_url):
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite keeps no plan on a server")
    return make_app(_config())


def _batch(size: int = 20) -> list[inbox.Message]:
    return [message(f"k{next(_keys)}") for _ in range(size)]


def _store_batches(count: int = BATCHES) -> None:
    for n in range(count):
        outcomes = inbox.receive_many(_batch(), positions=[at(0, n + 1)])
        assert all(isinstance(o, inbox.Accepted) for o in outcomes)


def _grow_events_past(size: int) -> None:
    """Fill the events table (rows of another source) until it takes ``size`` bytes."""
    with db.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO events (source, dedup_key, fingerprint, body, headers, meta, "
                "received_at) SELECT 'filler', 'f' || g, 'f', "
                "convert_to(repeat('x', 900), 'UTF8'), '[]', '{}', now() "
                "FROM generate_series(1, :rows) AS g"
            ),
            {"rows": size // 900 + 200},
        )
        assert conn.scalar(text("SELECT pg_relation_size('events')")) >= size


def _kept_batch_statements() -> list[Any]:
    """The batch statements prepared on the pool's one connection, the one the batches used.

    Read outside any transaction: psycopg deallocates every prepared
    statement on a rollback, as the pool's reset of a connection would be.
    """
    assert db.engine.pool.checkedin() == 1  # else another connection could hold them
    with autocommit_connection() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT name, cardinality(parameter_types) FROM pg_prepared_statements "
                    "WHERE statement LIKE 'WITH batch AS%'"
                )
            )
        )


def test_a_small_events_table_is_planned_for_each_batch(pg_app):
    with pg_app.app_context():
        _store_batches()
        assert _kept_batch_statements() == []
        assert db.session.scalar(select(func.count()).select_from(Event)) == BATCHES * 20


def test_a_large_events_table_keeps_the_plan_and_it_reads_events_by_the_unique_index(pg_app):
    with pg_app.app_context():
        _grow_events_past(PREPARED_FROM_BYTES)
        # The first batch sees the size; those after it are prepared.
        _store_batches()
        kept = _kept_batch_statements()
        assert len(kept) == 1
        ((name, parameters),) = kept
        with autocommit_connection() as conn:
            # The plan PostgreSQL keeps for every batch, whatever its rows.
            conn.execute(text("SET plan_cache_mode = force_generic_plan"))
            nulls = ", ".join(["NULL"] * parameters)
            plan = "\n".join(conn.execute(text(f"EXPLAIN EXECUTE {name}({nulls})")).scalars())
            conn.execute(text("RESET plan_cache_mode"))
        assert "Index Scan using uq_events_source_dedup_key on events" in plan, plan
        assert "Seq Scan on events" not in plan, plan
        assert inbox.stored_positions(SOURCE) == {("orders", 0): BATCHES}
        # Stored as before: each new, then each found again.
        again = inbox.receive_many([message("k0-again"), message("k0-again")])
        assert isinstance(again[0], inbox.Accepted) and isinstance(again[1], inbox.Duplicate)


def test_behind_a_transaction_pooler_nothing_is_prepared(make_app, db_url):
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite keeps no plan on a server")
    app = make_app(_config(), TRANSACTION_POOLER=True)
    with app.app_context():
        _grow_events_past(PREPARED_FROM_BYTES)
        _store_batches()
        assert _kept_batch_statements() == []
