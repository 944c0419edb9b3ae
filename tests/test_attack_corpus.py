"""Inputs that once answered 500 (or worse), as a table: each gets its 4xx and stores nothing.

The corpus comes from an attacker's pass over every surface: numbers that
overflow, ids past 64 bits, timestamps of thousands of digits, repeated JSON
member names, dates that leave the calendar when moved to UTC. Each row
names the request and the answer it must get; after every row the tables
that hold what was received are as they were.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from webhook_receiver.models import Delivery, Event, EventConflict, IdempotencyRecord

from .admin.conftest import PASSWORD, csrf_token, login
from .conftest import CLIENTS, bearer
from .helpers import count, counts
from .helpers import signing as s

BIG = 2**63  # one past the largest row id

NINES = "9" * 5000

STORED = (Event, EventConflict, Delivery)


@pytest.fixture
def app(make_app: Callable[..., Flask]) -> Flask:
    return make_app({"clients": CLIENTS, "sources": s.SOURCES}, ADMIN_PASSWORD=PASSWORD)


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    status: int
    problem: str | None = None  # the problem type's slug, on /api and /webhooks
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    form: dict[str, str] | None = None  # an admin form, posted with its CSRF token
    signed: bool = False  # a body validly signed for Stripe, now


def _api(body: bytes, key: str) -> dict[str, Any]:
    return {
        "body": body,
        "headers": {**bearer(), "Idempotency-Key": key, "Content-Type": "application/json"},
    }


def _svix(timestamp: str) -> dict[str, str]:
    return {
        "webhook-id": "msg_1",
        "webhook-timestamp": timestamp,
        "webhook-signature": "v1," + "A" * 44,
        "Content-Type": "application/json",
    }


def _stripe_body(body: bytes) -> dict[str, Any]:
    return {"body": body, "signed": True}


API_AND_WEBHOOKS = [
    Case(
        "api-number-overflowing-a-double",
        "POST",
        "/api/events",
        400,
        "invalid-json",
        **_api(b'{"type":"x","data":1e400}', "k-1e400"),
    ),
    Case(
        "api-negative-overflow",
        "POST",
        "/api/events",
        400,
        "invalid-json",
        **_api(b'{"type":"x","data":[-5e400]}', "k-5e400"),
    ),
    Case(
        "api-duplicate-member-names",
        "POST",
        "/api/events",
        400,
        "invalid-json",
        **_api(b'{"type":"x","type":"y","data":1}', "k-dup"),
    ),
    Case(
        "api-nested-duplicate-member-names",
        "POST",
        "/api/events",
        400,
        "invalid-json",
        **_api(b'{"type":"x","data":{"a":1,"a":2}}', "k-dup-nested"),
    ),
    Case(
        "api-event-id-past-64-bits",
        "GET",
        f"/api/events/{BIG}",
        404,
        "not-found",
        headers=bearer(),
    ),
    Case(
        "api-event-id-far-past-64-bits",
        "GET",
        "/api/events/" + "9" * 40,
        404,
        "not-found",
        headers=bearer(),
    ),
    Case(
        "stripe-timestamp-of-5000-digits",
        "POST",
        "/webhooks/stripe-live",
        401,
        "signature-invalid",
        body=b'{"id":"evt_1"}',
        headers={
            "Stripe-Signature": f"t={NINES},v1={'0' * 64}",
            "Content-Type": "application/json",
        },
    ),
    Case(
        "stripe-validly-signed-timestamp-10-to-the-400",
        "POST",
        "/webhooks/stripe-live",
        401,
        "signature-invalid",
        body=b'{"id":"evt_1"}',
        headers=s.stripe_signed(b'{"id":"evt_1"}', 10**400),
    ),
    Case(
        "standard-webhooks-timestamp-of-5000-digits",
        "POST",
        "/webhooks/svix",
        401,
        "signature-invalid",
        body=b'{"type":"x"}',
        headers=_svix(NINES),
    ),
    Case(
        "webhook-id-overflowing-a-double",
        "POST",
        "/webhooks/stripe-live",
        400,
        "payload-invalid",
        **_stripe_body(b'{"id":1e400,"type":"x"}'),
    ),
    Case(
        "webhook-another-id-overflowing-a-double",
        "POST",
        "/webhooks/stripe-live",
        400,
        "payload-invalid",
        **_stripe_body(b'{"id":5e400,"type":"x"}'),
    ),
    Case(
        "webhook-duplicate-member-names",
        "POST",
        "/webhooks/stripe-live",
        400,
        "payload-invalid",
        **_stripe_body(b'{"id":"a","id":"b","type":"x"}'),
    ),
]

ADMIN = [
    Case("admin-event-id-past-64-bits", "GET", f"/admin/events/{BIG}", 404),
    Case("admin-conflict-id-past-64-bits", "GET", f"/admin/conflicts/{BIG}", 404),
    Case("admin-cursor-id-past-64-bits", "GET", "/admin/events?before=1.99999999999999999999", 400),
    Case("admin-cursor-id-at-2-to-the-63", "GET", "/admin/events?after=1.9223372036854775808", 400),
    Case("admin-dead-cursor-past-64-bits", "GET", "/admin/dead?before=1.99999999999999999999", 400),
    Case("admin-conflicts-cursor", "GET", "/admin/conflicts?after=1.9223372036854775808", 400),
    Case(
        "admin-idempotency-cursor", "GET", "/admin/idempotency?before=1.99999999999999999999", 400
    ),
    Case("admin-rejections-cursor", "GET", "/admin/rejections?after=1.9223372036854775808", 400),
    Case("admin-cursor-time-of-5000-digits", "GET", f"/admin/events?before={NINES}.1", 400),
    Case("admin-search-superscript-two", "GET", "/admin/events?q=%C2%B2", 200),
    Case("admin-search-id-past-64-bits", "GET", f"/admin/events?q={BIG}", 200),
    Case(
        "admin-since-before-year-one-in-utc",
        "GET",
        "/admin/events?since=0001-01-01T00:00%2B01:00",
        200,
    ),
    Case(
        "admin-until-after-year-9999-in-utc",
        "GET",
        "/admin/events?until=9999-12-31T23:59-01:00",
        200,
    ),
    Case(
        "admin-requeue-id-past-64-bits",
        "POST",
        "/admin/deliveries/requeue",
        400,
        form={"ids": "9" * 23},
    ),
    Case(
        "admin-requeue-page-id-past-64-bits",
        "POST",
        "/admin/deliveries/requeue",
        400,
        form={"page_ids": f"1,{BIG}"},
    ),
    Case(
        "admin-requeue-superscript-id", "POST", "/admin/deliveries/requeue", 400, form={"ids": "²"}
    ),
    Case(
        "admin-discard-id-past-64-bits",
        "POST",
        "/admin/deliveries/discard",
        400,
        form={"ids": "9" * 23, "confirm": "yes"},
    ),
    Case("admin-evict-id-past-64-bits", "POST", f"/admin/idempotency/{BIG}/evict", 404, form={}),
    Case(
        "admin-review-id-past-64-bits",
        "POST",
        f"/admin/conflicts/{BIG}/review",
        404,
        form={"note": "x"},
    ),
]


def _send(client: FlaskClient, case: Case) -> Any:
    headers = case.headers
    if case.signed:
        headers = s.stripe_signed(case.body or b"", int(time.time()))
    if case.form is not None:
        token = csrf_token(client, "/admin/")
        return client.post(case.path, data={**case.form, "csrf_token": token})
    return client.open(case.path, method=case.method, data=case.body, headers=headers)


@pytest.mark.parametrize("case", API_AND_WEBHOOKS, ids=lambda c: c.name)
def test_api_and_webhook_attack_corpus(app: Flask, case: Case) -> None:
    client = app.test_client()
    before = counts(app, *STORED)
    response = _send(client, case)
    assert response.status_code == case.status, response.get_data(as_text=True)
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == f"/problems/{case.problem}"
    assert counts(app, *STORED) == before


@pytest.mark.parametrize("case", ADMIN, ids=lambda c: c.name)
def test_admin_attack_corpus(app: Flask, case: Case) -> None:
    client = app.test_client()
    assert login(client).status_code == 302
    before = counts(app, *STORED)
    response = _send(client, case)
    assert response.status_code == case.status, response.get_data(as_text=True)[:2000]
    assert counts(app, *STORED) == before
    assert count(app, IdempotencyRecord) == 0


def test_an_api_event_with_big_but_finite_numbers_is_stored_and_replayed_as_json(
    app: Flask,
) -> None:
    client = app.test_client()
    body = b'{"type":"x","data":[1e308,-1e308,123456789012345678901234567890]}'
    headers = {**bearer(), "Idempotency-Key": "finite", "Content-Type": "application/json"}
    first = client.post("/api/events", data=body, headers=headers)
    again = client.post("/api/events", data=body, headers=headers)
    assert first.status_code == again.status_code == 201
    assert b"Infinity" not in first.data
    assert json.loads(first.data)["data"] == [1e308, -1e308, 123456789012345678901234567890]
    assert again.data == first.data
