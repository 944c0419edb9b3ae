"""Inputs that once answered 500 (or worse), as a table: each gets its 4xx and stores nothing.

The corpus comes from an attacker's pass over every surface: numbers that
overflow, ids past 64 bits, timestamps of thousands of digits, repeated JSON
member names, dates that leave the calendar when moved to UTC. Each row
names the request and the answer it must get; after every row the tables
that hold what was received are as they were.
"""

from __future__ import annotations

import ast
import hashlib
import hmac
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import create_engine, func, select

from webhook_receiver import rejections
from webhook_receiver.admin.presenters import MAX_DIFF_LINES, Segment, compare_bodies
from webhook_receiver.events import REDACTED
from webhook_receiver.extensions import db
from webhook_receiver.models import (
    Delivery,
    Event,
    EventConflict,
    IdempotencyRecord,
    Rejection,
)
from webhook_receiver.webhooks.providers import PROVIDERS, redacted_headers

from .admin.conftest import PASSWORD, conflict, csrf_token, delivery, event, login
from .conftest import CLIENTS, bearer
from .databases import read_only
from .servers import gunicorn
from .test_idempotency import make_test_blueprint
from .webhooks import signing as s
from .webhooks.deliveries import delivery_for

BIG = 2**63  # one past the largest row id
NINES = "9" * 5000
STORED = (Event, EventConflict, Delivery)


@pytest.fixture
def app(make_app: Callable[..., Flask]) -> Flask:
    return make_app({"clients": CLIENTS, "sources": s.SOURCES}, ADMIN_PASSWORD=PASSWORD)


def counts(app: Flask) -> dict[str, int]:
    """Rows of every table that holds what was received."""
    with app.app_context():
        found = {
            model.__tablename__: db.session.scalar(select(func.count()).select_from(model))
            for model in STORED
        }
        db.session.rollback()
        return found


def stripe_signed(body: bytes, t: int | str) -> dict[str, str]:
    """Headers that sign ``body`` for Stripe at ``t``, however large."""
    message = f"{t}.".encode() + body
    digest = hmac.new(s.STRIPE_SECRET.encode(), message, hashlib.sha256).hexdigest()
    return {"Stripe-Signature": f"t={t},v1={digest}", "Content-Type": "application/json"}


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
        headers=stripe_signed(b'{"id":"evt_1"}', 10**400),
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
        headers = stripe_signed(case.body or b"", int(time.time()))
    if case.form is not None:
        token = csrf_token(client, "/admin/")
        return client.post(case.path, data={**case.form, "csrf_token": token})
    return client.open(case.path, method=case.method, data=case.body, headers=headers)


@pytest.mark.parametrize("case", API_AND_WEBHOOKS, ids=lambda c: c.name)
def test_api_and_webhook_attack_corpus(app: Flask, case: Case) -> None:
    client = app.test_client()
    before = counts(app)
    response = _send(client, case)
    assert response.status_code == case.status, response.get_data(as_text=True)
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == f"/problems/{case.problem}"
    assert counts(app) == before


@pytest.mark.parametrize("case", ADMIN, ids=lambda c: c.name)
def test_admin_attack_corpus(app: Flask, case: Case) -> None:
    client = app.test_client()
    assert login(client).status_code == 302
    before = counts(app)
    response = _send(client, case)
    assert response.status_code == case.status, response.get_data(as_text=True)[:2000]
    assert counts(app) == before
    with app.app_context():
        assert db.session.scalar(select(func.count()).select_from(IdempotencyRecord)) == 0


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


# -- a malformed chunked body, through a real gunicorn -------------------------

GUNICORN_CONFIG = f"""
[sources.stripe-live]
provider = "stripe"
secrets = ["{s.STRIPE_SECRET}"]

[clients.acme]
token = "{CLIENTS["acme"]["token"]}"
"""


def raw_request(url: str, request: bytes) -> tuple[int, str, bytes]:
    """Send bytes as they are; return the status, the Content-Type and the body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), fields.get("Content-Type", ""), body


@pytest.mark.slow
@pytest.mark.parametrize("size_line", [b"zz", b"ffffffffffffffffffff", b"-1", b"5;\rx"])
def test_a_malformed_chunk_size_is_a_400_on_every_path(db_url, tmp_path, size_line) -> None:
    with gunicorn(db_url, GUNICORN_CONFIG, tmp_path, workers=1) as server:
        for path, problem_json in [
            ("/webhooks/stripe-live", True),
            ("/api/events", True),
            ("/admin/login", False),
            ("/nowhere", False),
        ]:
            status, content_type, body = raw_request(
                server.url,
                b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                + size_line
                + b"\r\nabc\r\n0\r\n\r\n",
            )
            assert status == 400, (path, status, body[:300])
            if problem_json:
                assert content_type == "application/problem+json", (path, body[:300])
        assert requests.get(server.url + "/healthz", timeout=5).status_code == 200


# -- secrets: compared in constant time, never stored ---------------------------

SECRETISH = re.compile(r"digest|signature|secret|token|hmac|password|passwd", re.IGNORECASE)
# Where requests are authenticated, every comparison of two values that are
# not literals is suspect: there ``e == g`` may well be two digests.
AUTHENTICATING = ("webhooks/providers/", "admin/auth.py", "api/auth.py", "observability/metrics.py")
PACKAGE = Path(__file__).resolve().parent.parent / "webhook_receiver"


def _is_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name | ast.Attribute):  # a CONSTANT or module.CONSTANT
        return (node.id if isinstance(node, ast.Name) else node.attr).isupper()
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return all(_is_literal(e) for e in node.elts)
    # Lengths, types and the sets of names compared at import are not secrets.
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("len", "type", "set", "frozenset")
    )


def _is_sql(node: ast.expr) -> bool:
    # ``table.c.lease_token == token`` and ``Model.token_hash == digest`` build
    # SQL: the database looks the value up (by index), nothing is timed here.
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id[:1].isupper() and not node.value.id.isupper():
            return True
    return any(isinstance(sub, ast.Attribute) and sub.attr == "c" for sub in ast.walk(node))


def _names(node: ast.expr) -> list[str]:
    return [
        sub.id if isinstance(sub, ast.Name) else sub.attr
        for sub in ast.walk(node)
        if isinstance(sub, ast.Name | ast.Attribute)
    ]


def non_constant_time_comparisons() -> list[str]:
    """Each ==, !=, in or not in that may compare a secret or a digest, as path:line: code."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        strict = relative.startswith(AUTHENTICATING)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            for op, a, b in zip(node.ops, operands, operands[1:], strict=False):
                if not isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn):
                    continue
                if any(_is_literal(x) or _is_sql(x) for x in (a, b)):
                    continue
                if strict or any(SECRETISH.search(n) for n in _names(a) + _names(b)):
                    found.append(f"{relative}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_secrets_and_digests_are_compared_in_constant_time() -> None:
    # hmac.compare_digest (or a provider's any_match / same_token) only: an
    # early-exit == tells an attacker, byte by byte, how much of a guess is right.
    assert non_constant_time_comparisons() == []


CREDENTIAL_HEADERS = {
    "X-Api-Key": "key-123",
    "X-Auth-Token": "tok-123",
    "X-Client-Secret": "sec-123",
    "X-Access-Key": "acc-123",
    "X-Amz-Security-Token": "amz-123",
    "Proxy-Authorization": "Basic eA==",
    "Cookie": "session=abc",
}


def test_every_providers_secret_headers_and_credentials_are_stored_redacted(app: Flask) -> None:
    file_config = app.config["FILE_CONFIG"]
    covered = {file_config.sources[name].provider for name in s.SOURCES}
    assert covered == set(PROVIDERS), "a provider without a source here is not checked"
    client = app.test_client()
    for n, name in enumerate(s.SOURCES):
        body, headers = delivery_for(name, f"redact-{name}-{n}")
        response = client.post(
            f"/webhooks/{name}", data=body, headers={**headers, **CREDENTIAL_HEADERS}
        )
        assert response.status_code == 200, (name, response.get_data(as_text=True))
        with app.app_context():
            event = db.session.get(Event, response.get_json()["event_id"])
            stored = {k.lower(): v for k, v in event.headers}
        secret = redacted_headers(file_config.sources[name]) | {
            k.lower() for k in CREDENTIAL_HEADERS
        }
        for header in secret:
            if header in stored:
                assert stored[header] == REDACTED, (name, header)
        sent = {k.lower(): v for k, v in headers.items()}
        # Each provider's own signature (or token) header was sent and is hidden.
        assert any(
            h in sent and stored[h] == REDACTED for h in redacted_headers(file_config.sources[name])
        ), name
        for value in [*CREDENTIAL_HEADERS.values(), *(sent[h] for h in secret if h in sent)]:
            assert value not in json.dumps(event.headers), (name, value)


# -- the Idempotency-Key fingerprint covers the path ---------------------------


def test_same_key_and_body_on_two_idempotent_paths_is_a_mismatch(make_app) -> None:
    app = make_app(PROPAGATE_EXCEPTIONS=False)
    app.register_blueprint(make_test_blueprint())
    client = app.test_client()
    headers = {**bearer(), "Idempotency-Key": "one-key", "Content-Type": "application/json"}
    first = client.post("/t/ok", data=b'{"a":1}', headers=headers)
    assert first.status_code == 201
    other = client.post("/t/who", data=b'{"a":1}', headers=headers)
    assert other.status_code == 422, other.get_data(as_text=True)
    assert other.get_json()["type"] == "/problems/idempotency-key-reused"
    with app.app_context():
        assert db.session.scalar(select(func.count()).select_from(IdempotencyRecord)) == 1


# -- readiness means taking writes ---------------------------------------------


def test_readyz_is_503_while_the_database_refuses_writes(make_app, db_url) -> None:
    writable = make_app().test_client()
    assert writable.get("/readyz").status_code == 200
    client = make_app(**read_only(db_url)).test_client()
    # Reads still work (the probe used to stop there) ...
    assert client.get("/api/events/1", headers=bearer()).status_code == 404
    # ... but a delivery could not be stored.
    response = client.get("/readyz")
    assert response.status_code == 503, response.get_data(as_text=True)
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == "/problems/database-unavailable"
    assert client.get("/healthz").status_code == 200


def test_writes_to_a_read_only_database_are_503_and_never_2xx(make_app, db_url) -> None:
    # A standby after a failover: PostgreSQL refuses each write with
    # read_only_sql_transaction, which psycopg files under InternalError
    # (it was a 500 "internal-error"); SQLite's read-only file is an
    # OperationalError. Either way the sender must retry later.
    config = {"clients": CLIENTS, "sources": {"stripe-live": s.SOURCES["stripe-live"]}}
    app = make_app(config, **read_only(db_url))
    client = app.test_client()
    body = b'{"id":"evt_read_only","type":"charge.succeeded"}'
    writes = [
        client.post(
            "/api/events",
            data=b'{"type":"t","data":{}}',
            headers={
                **bearer(),
                "Idempotency-Key": "read-only-1",
                "Content-Type": "application/json",
            },
        ),
        client.post(
            "/webhooks/stripe-live", data=body, headers=stripe_signed(body, int(time.time()))
        ),
    ]
    for response in writes:
        assert response.status_code == 503, response.get_data(as_text=True)
        assert response.mimetype == "application/problem+json"
        assert response.get_json()["type"] == "/problems/database-unavailable"
        assert response.headers["Retry-After"]
    writable = make_app(config)
    with writable.app_context():
        assert db.session.scalar(select(func.count()).select_from(Event)) == 0
        assert db.session.scalar(select(func.count()).select_from(IdempotencyRecord)) == 0


# -- the login throttle under concurrent guesses ---------------------------------


def test_concurrent_wrong_passwords_get_at_most_the_limit_of_tries(app: Flask) -> None:
    limit, guesses = app.config["ADMIN_LOGIN_MAX_FAILURES"], 40
    clients = [app.test_client() for _ in range(guesses)]
    tokens = [csrf_token(client, "/admin/login") for client in clients]
    start = threading.Barrier(guesses)

    def guess(n: int) -> int:
        start.wait()
        form = {"password": f"wrong-{n}", "csrf_token": tokens[n]}
        return clients[n].post("/admin/login", data=form).status_code

    with ThreadPoolExecutor(max_workers=guesses) as pool:
        statuses = list(pool.map(guess, range(guesses)))
    assert set(statuses) <= {200, 429}, statuses
    # 200 is the form again with "Wrong password.": a try that reached the check.
    assert statuses.count(200) <= limit, statuses
    assert statuses.count(429) >= guesses - limit
    # The right password from that address is throttled too, for the window.
    assert login(app.test_client()).status_code == 429


# -- logging out ends the session on the server ----------------------------------


def test_logout_revokes_a_copied_session_cookie(app: Flask) -> None:
    event_id = event(app)
    dead_id = delivery(app, event_id, state="dead", attempts=8)
    browser = app.test_client()
    assert login(browser).status_code == 302
    cookie = browser.get_cookie("session")
    assert cookie is not None
    thief = app.test_client()
    thief.set_cookie("session", cookie.value)
    assert thief.get("/admin/").status_code == 200  # the copy works while the session is open
    token = csrf_token(thief, "/admin/")

    assert browser.post("/admin/logout", data={"csrf_token": csrf_token(browser, "/admin/")})
    assert browser.get("/admin/").status_code == 302

    # The copy, taken before the logout, opens nothing now: no page, no action.
    page = thief.get("/admin/")
    assert page.status_code == 302 and "/admin/login" in page.headers["Location"]
    requeue = thief.post("/admin/deliveries/requeue", data={"ids": dead_id, "csrf_token": token})
    assert requeue.status_code == 403
    with app.app_context():
        assert db.session.get(Delivery, dead_id).state == "dead"


def test_a_new_login_after_logout_works_and_the_old_cookie_stays_dead(app: Flask) -> None:
    client = app.test_client()
    assert login(client).status_code == 302
    old = client.get_cookie("session").value
    client.post("/admin/logout", data={"csrf_token": csrf_token(client, "/admin/")})
    assert login(client).status_code == 302
    assert client.get("/admin/").status_code == 200
    stale = app.test_client()
    stale.set_cookie("session", old)
    assert stale.get("/admin/").status_code == 302


# -- a flood of forgeries is a count, not a row each ------------------------------


def _forged(client: FlaskClient, n: int, addr: str = "198.51.100.7") -> int:
    return client.post(
        "/webhooks/stripe-live",
        data=b'{"id":"evt_forged"}',
        headers={"Stripe-Signature": f"t={n},v1={'0' * 64}", "Content-Type": "application/json"},
        environ_base={"REMOTE_ADDR": addr},
    ).status_code


def rejection_rows(app: Flask) -> list[tuple[str, str, str, int]]:
    with app.app_context():
        rows = db.session.execute(
            select(
                Rejection.source, Rejection.reason, Rejection.remote_addr, Rejection.seen_count
            ).order_by(Rejection.remote_addr)
        ).all()
        db.session.rollback()
        return [tuple(row) for row in rows]


def test_a_flood_of_bad_signatures_is_one_counted_row_per_address_and_minute(app: Flask) -> None:
    client = app.test_client()
    statuses = {_forged(client, n) for n in range(300)}
    statuses |= {_forged(client, n, "203.0.113.1") for n in range(20)}
    assert statuses == {401}
    rows = rejection_rows(app)
    # Two addresses: two rows (three if the minute turned meanwhile), 320 refusals.
    assert 2 <= len(rows) <= 4, rows
    assert sum(row[3] for row in rows) == 320
    assert {row[2] for row in rows} == {"198.51.100.7", "203.0.113.1"}


def test_batched_refusals_write_nothing_per_request_then_add_up(make_app) -> None:
    app = make_app({"sources": s.SOURCES}, REJECTION_FLUSH_SECONDS=3600)
    client = app.test_client()
    for n in range(200):
        assert _forged(client, n) == 401
    # Counted in the process; not one write yet, so not one turn at the lock.
    assert rejection_rows(app) == []
    counter = rejections.counter(app)
    assert counter.pending() == 200
    counter.close()
    rows = rejection_rows(app)
    assert sum(row[3] for row in rows) == 200 and len(rows) <= 2
    # Another process's batch (or a later one) adds to the same minute's row.
    for n in range(5):
        assert _forged(client, n) == 401
    counter.flush()
    assert sum(row[3] for row in rejection_rows(app)) == 205
    assert len(rejection_rows(app)) <= 3  # one per minute the test spans


# -- the conflict diff is bounded ------------------------------------------------


def _items(n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    items = [{"id": i, "v": rng.random(), "name": "x" * rng.randint(1, 30)} for i in range(n)]
    return json.dumps({"id": "evt_big", "items": items}).encode()


def test_a_conflict_past_the_diff_bounds_shows_both_bodies_plainly(app: Flask) -> None:
    original = _items(1500, 1)  # about 100 KB, every line different
    event_id = event(app, body=original)
    conflict_id = conflict(app, event_id, body=_items(1500, 2))
    client = app.test_client()
    assert login(client).status_code == 302
    response = client.get(f"/admin/conflicts/{conflict_id}")
    assert response.status_code == 200
    page = response.get_data(as_text=True)
    assert 'id="body-too-large"' in page and 'id="body-plain"' in page
    assert 'id="body-diff"' not in page
    # Both bodies are there in full (pretty-printed), the last item included.
    assert page.count("&#34;id&#34;: 1499") == 2
    # Small headers are still compared.
    assert 'id="header-diff"' in page


def test_a_small_conflict_is_still_highlighted(app: Flask) -> None:
    event_id = event(app, body=b'{"id":"evt_1","amount":100}')
    conflict_id = conflict(app, event_id, body=b'{"id":"evt_1","amount":250}')
    client = app.test_client()
    assert login(client).status_code == 302
    page = client.get(f"/admin/conflicts/{conflict_id}").get_data(as_text=True)
    assert 'id="body-diff"' in page and "too-large" not in page
    assert "<mark>250</mark>" in page


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (["x" * 1024] * 1024, ["y" * 1024] * 1024),  # 1 MB a side
        (["a"] * (MAX_DIFF_LINES + 1), ["b"]),  # many short lines
        (["k" * 40_000], ["j" * 40_000]),  # one long line
    ],
    ids=["one-megabyte", "lines", "bytes"],
)
def test_compare_bodies_past_the_bounds_does_not_match_lines(left, right) -> None:
    diff = compare_bodies(left, right)
    assert not diff.bounded and diff.rows == []
    assert diff.left == "\n".join(left) and diff.right == "\n".join(right)


def test_long_lines_within_the_bounds_are_marked_whole() -> None:
    diff = compare_bodies(["a " * 400], ["b " * 400])
    assert diff.bounded
    (row,) = diff.rows
    assert row.left == (Segment("a " * 400, True),)
    assert row.right == (Segment("b " * 400, True),)


# -- what a process writes when it exits ---------------------------------------------

EXITING_PROCESS = """
import sys
from webhook_receiver import create_app
from tests.conftest import SECRET_KEY
from tests.webhooks import signing as s

app = create_app({
    "TESTING": True,
    "SECRET_KEY": SECRET_KEY,
    "SQLALCHEMY_DATABASE_URI": sys.argv[1],
    "DUPLICATE_FLUSH_SECONDS": 3600,
    "REJECTION_FLUSH_SECONDS": 3600,
    "RECEIVER_CONFIG": {"sources": s.SOURCES},
})
client = app.test_client()
body, headers = s.stripe_delivery({"id": "evt_exit", "type": "invoice.paid"})
for _ in range(3):
    assert client.post("/webhooks/stripe-live", data=body, headers=headers).status_code == 200
forged = {"Stripe-Signature": "t=1,v1=" + "0" * 64, "Content-Type": "application/json"}
for _ in range(4):
    assert client.post("/webhooks/stripe-live", data=b"{}", headers=forged).status_code == 401
# An hour's interval: nothing written yet, and the process now simply ends.
"""


def test_a_process_exiting_writes_its_pending_redeliveries_and_refusals(db_url) -> None:
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", EXITING_PROCESS, db_url],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            counts = conn.execute(select(Event.duplicate_count)).scalars().all()
            refused = conn.scalar(select(func.sum(Rejection.seen_count)))
    finally:
        engine.dispose()
    assert counts == [2]  # the two redeliveries, written by the exit hook
    assert refused == 4


# -- a dedup key's header sent twice ---------------------------------------------


@pytest.mark.parametrize(
    ("source", "header"),
    [("ce", "ce-id"), ("ce", "ce-source"), ("svix", "webhook-id")],
)
def test_a_dedup_key_header_sent_twice_is_400_and_stores_nothing(make_app, source, header):
    # gunicorn joins a repeated header with a comma. CloudEvents' binary-mode
    # ce-id and ce-source were read as they came, so "1,1" was a new key and
    # a repeated header let a redelivery through as a new event; a doubled
    # webhook-id was refused as a forgery (401) rather than as malformed.
    app = make_app({"clients": CLIENTS, "sources": s.SOURCES})
    client = app.test_client()
    body, headers = delivery_for(source, "key-1")
    headers = {**headers, header: f"{headers[header]},{headers[header]}"}
    response = client.post(f"/webhooks/{source}", data=body, headers=headers)
    assert response.status_code == 400, response.get_data(as_text=True)
    assert response.get_json()["type"] == "/problems/payload-invalid"
    assert "more than once" in response.get_json()["detail"]
    with app.app_context():
        assert db.session.scalar(select(func.count()).select_from(Event)) == 0
        assert db.session.scalar(select(func.count()).select_from(Rejection)) == 0


def test_an_unexpected_error_on_the_api_is_problem_json(make_app) -> None:
    app = make_app(PROPAGATE_EXCEPTIONS=False)

    def boom():
        raise RuntimeError("a bug")

    app.add_url_rule("/api/boom", "boom", boom)
    response = app.test_client().get("/api/boom")
    assert response.status_code == 500
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == "/problems/internal-error"
    assert "a bug" not in response.get_data(as_text=True)
