"""Ordering by entity version: stale events are skipped, per consumer."""

from __future__ import annotations

import json

import pytest

from webhook_receiver.extensions import db
from webhook_receiver.models import EntityVersion
from webhook_receiver.outbox import ordering

from .conftest import FAST, config_with, delivery, drain, forward, store_event


def _event(app, clock, key, entity, version, event_type="order.paid"):
    return store_event(
        app,
        clock,
        dedup_key=key,
        event_type=event_type,
        data={"object": {"id": entity, "version": version}},
    )


def test_stale_version_is_skipped_by_a_forward(make_app, downstream, clock, make_worker):
    app = make_app(
        config_with([forward("billing", downstream.url + "/billing")], ordered=True), **FAST
    )
    worker = make_worker(app, clock)
    v2 = _event(app, clock, "evt-2", "cus_1", 2)
    assert drain(app, worker) == ["delivered"]
    v1 = _event(app, clock, "evt-1", "cus_1", 1)
    other = _event(app, clock, "evt-x", "cus_2", 1)
    again = _event(app, clock, "evt-2b", "cus_1", 2)
    assert drain(app, worker) == ["skipped", "delivered", "delivered"]
    row = delivery(app, v1, "billing")
    assert (row["state"], row["last_error"]) == ("skipped", ordering.STALE)
    assert delivery(app, v2, "billing")["state"] == "delivered"
    assert delivery(app, other, "billing")["state"] == "delivered"
    assert delivery(app, again, "billing")["state"] == "delivered"
    sent = [c.headers["Idempotency-Key"] for c in downstream.calls_to("/billing")]
    assert sent == ["billing:shop:evt-2", "billing:shop:evt-x", "billing:shop:evt-2b"]


def test_stale_version_is_skipped_by_a_handler_without_running_it(
    make_app, clock, make_worker, ledger
):
    app = make_app(config_with(handlers=True, ordered=True), **FAST)
    ledger(app)
    worker = make_worker(app, clock)
    v10 = _event(app, clock, "evt-10", "cus_1", 10, event_type="order.refunded")
    assert drain(app, worker) == ["delivered"]
    v9 = _event(app, clock, "evt-9", "cus_1", 9, event_type="order.refunded")
    assert drain(app, worker) == ["skipped"]
    assert ledger(app) == [(v10, "audit")]
    assert delivery(app, v9, "audit")["state"] == "skipped"


def test_versions_are_kept_per_consumer(make_app, clock, make_worker, ledger):
    # "audit" sees every type, "ledger" only order.paid: audit's newer
    # refund must not make ledger skip a payment it never saw.
    app = make_app(config_with(handlers=True, ordered=True), **FAST)
    ledger(app)
    worker = make_worker(app, clock)
    refund = _event(app, clock, "evt-5", "cus_1", 5, event_type="order.refunded")
    assert drain(app, worker) == ["delivered"]
    paid = _event(app, clock, "evt-4", "cus_1", 4, event_type="order.paid")
    assert sorted(drain(app, worker)) == ["delivered", "skipped"]
    assert delivery(app, paid, "ledger")["state"] == "delivered"
    assert delivery(app, paid, "audit")["state"] == "skipped"
    assert sorted(ledger(app)) == [(refund, "audit"), (paid, "ledger")]
    with app.app_context():
        got = {(v.entity, v.version) for v in db.session.query(EntityVersion)}
        db.session.rollback()
    assert got == {("audit:cus_1", ordering.sortable(5)), ("ledger:cus_1", ordering.sortable(4))}


def test_a_failed_handler_does_not_advance_the_version(make_app, clock, make_worker, ledger):
    from . import handlers

    app = make_app(config_with(handlers=True, ordered=True), **FAST)
    ledger(app)
    worker = make_worker(app, clock)
    handlers.failures["audit"] = 1
    _event(app, clock, "evt-7", "cus_1", 7, event_type="order.refunded")
    assert drain(app, worker) == ["retry"]
    v6 = _event(app, clock, "evt-6", "cus_1", 6, event_type="order.refunded")
    assert drain(app, worker) == ["delivered"]
    assert delivery(app, v6, "audit")["state"] == "delivered"


def test_events_without_version_are_applied(make_app, downstream, clock, make_worker):
    app = make_app(
        config_with([forward("billing", downstream.url + "/billing")], ordered=True), **FAST
    )
    worker = make_worker(app, clock)
    _event(app, clock, "evt-2", "cus_1", 2)
    drain(app, worker)
    bare = store_event(app, clock, dedup_key="evt-bare", data={"object": {"id": "cus_1"}})
    assert drain(app, worker) == ["delivered"]
    assert delivery(app, bare, "billing")["state"] == "delivered"


@pytest.mark.parametrize(
    ("entity", "version"),
    [("cus\u00001", 2), ("cus_1", "v\u00002"), ("cus\ud8001", 2), ("cus_1", "v\udfff")],
    ids=["nul-entity", "nul-version", "surrogate-entity", "surrogate-version"],
)
def test_an_entity_or_version_no_database_can_store_is_applied_unordered(
    make_app, downstream, clock, make_worker, entity, version
):
    # JSON's \u0000 and a lone \ud800 escape are valid in a body, and the
    # intake stores them (its bytes hold neither). As the delivery's entity
    # or version, PostgreSQL refuses the NUL and neither database encodes
    # the surrogate: every attempt raised out of the worker's thread, the
    # delivery leased until its lease ended, then dead without a call.
    app = make_app(
        config_with([forward("billing", downstream.url + "/billing")], ordered=True), **FAST
    )
    body = json.dumps(
        {"type": "order.paid", "data": {"object": {"id": entity, "version": version}}}
    )
    event_id = store_event(app, clock, dedup_key="evt-1", body=body.encode())
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    assert delivery(app, event_id, "billing")["state"] == "delivered"
    assert len(downstream.calls_to("/billing")) == 1
