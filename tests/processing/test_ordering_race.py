"""Ordering under concurrency: two transactions advancing one entity at once."""

from __future__ import annotations

import threading

from sqlalchemy import select

from webhook_receiver.database import unit_of_work
from webhook_receiver.extensions import db
from webhook_receiver.models import EntityVersion
from webhook_receiver.outbox import ordering

from .conftest import FAST, config_with, store_event


def test_an_older_version_waits_for_the_newer_ones_transaction_and_loses(make_app, clock):
    # Two handler transactions of one entity, 3 first: 2's upsert must wait for
    # 3's transaction (PostgreSQL's row/index lock, SQLite's write lock) and
    # then see 3, not decide on what it read before 3 committed.
    app = make_app(config_with(handlers=True, ordered=True), **FAST)
    v3 = store_event(app, clock, dedup_key="evt-3", data={})
    v2 = store_event(app, clock, dedup_key="evt-2", data={})
    three = ordering.Key("audit:cus_1", ordering.sortable(3))
    two = ordering.Key("audit:cus_1", ordering.sortable(2))
    advanced, release = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def newer() -> None:
        with app.app_context():
            with unit_of_work():
                results["3"] = ordering.advance("shop", three, v3, clock())
                advanced.set()
                release.wait(10)  # the handler runs, its transaction open

    def older() -> None:
        with app.app_context():
            try:
                with unit_of_work():
                    results["2"] = ordering.advance("shop", two, v2, clock())
            except Exception as exc:  # the test reports it, not the thread
                results["2"] = exc

    first = threading.Thread(target=newer)
    first.start()
    assert advanced.wait(10)
    second = threading.Thread(target=older)
    second.start()
    second.join(0.5)
    assert second.is_alive(), "2 decided while 3's transaction was still open"
    release.set()
    first.join(10)
    second.join(10)
    assert results == {"3": True, "2": False}
    with app.app_context():
        got = db.session.execute(select(EntityVersion.version, EntityVersion.event_id)).all()
        db.session.rollback()
    assert [tuple(r) for r in got] == [(ordering.sortable(3), v3)]
