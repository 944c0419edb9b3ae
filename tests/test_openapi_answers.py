"""Every answer the HTTP surface gives, refusals included, is the one /openapi.json describes.

Each operation is driven through its successes and every refusal a client
can provoke (no token, a bad one, bad JSON, a wrong media type, a body too
large, a bad or reused Idempotency-Key, an unknown id or source, the
database away), on SQLite and PostgreSQL. openapi-core validates each answer
(status, media type, body, documented headers); on top of that, a header the
answer carries must be documented for it, and a problem's members too: a
client generated from the document sees only what it lists.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from flask.testing import FlaskClient

from webhook_receiver.problems import PROBLEM_JSON

from .conftest import CLIENTS, GLOBEX_TOKEN, bearer
from .helpers import post_event
from .helpers.signing import hmac_hex
from .idempotency.test_one_commit import StatementGate, lock_waits
from .servers import free_port, wait_until
from .test_openapi import SOURCES, RecordingClient, _request_is_valid, _signed, api, checked, spec

__all__ = ["api", "spec"]  # fixtures

EVENT = {"type": "order.created", "data": {"order": 42}}
TOO_LARGE = b"x" * (1024 * 1024 + 1)

# (path template, method, response)
Answer = tuple[str, str, Any]


def _api_answers(api: FlaskClient) -> list[Answer]:
    json_type = {"Content-Type": "application/json"}
    created = post_event(api, "k-1", EVENT)
    answers = [
        created,
        post_event(api, "k-1", EVENT),  # replayed
        post_event(api, "k-1", {**EVENT, "data": 43}),  # key reused: 422
        api.post("/api/events", json=EVENT, headers=bearer()),  # no key
        post_event(api, "x" * 256, EVENT),  # key too long
        post_event(api, "k-2", b'{"type": '),  # not JSON
        post_event(api, "k-3", b"[]"),  # not an event
        post_event(api, "k-4", json.dumps(EVENT), content_type="text/plain"),
        post_event(api, "k-5", TOO_LARGE, headers=json_type),
        api.post("/api/events", json=EVENT, headers={"Idempotency-Key": "k-6"}),
        post_event(api, "k-7", EVENT, token="not-a-token"),
    ]
    found = [
        api.get(created.headers["Location"], headers=bearer()),
        api.get(created.headers["Location"], headers=bearer(GLOBEX_TOKEN)),
        api.get("/api/events/999999", headers=bearer()),
        api.get(f"/api/events/{2**63}", headers=bearer()),
        api.get(created.headers["Location"]),
        api.get(created.headers["Location"], headers=bearer("not-a-token")),
    ]
    return [("/api/events", "post", r) for r in answers] + [
        ("/api/events/{id}", "get", r) for r in found
    ]


def _webhook_answers(api: FlaskClient) -> list[Answer]:
    body, headers = _signed({"id": "evt-1", "type": "demo"})
    other, other_headers = _signed({"id": "evt-1", "type": "changed"})
    broken = b'{"id": '
    keyless = b'{"type": "demo"}'
    answers = [
        api.post("/webhooks/partner", data=body, headers=headers),
        api.post("/webhooks/partner", data=body, headers=headers),  # redelivered
        api.post("/webhooks/partner", data=other, headers=other_headers),  # 422
        api.post("/webhooks/partner", data=body, headers={**headers, "X-Signature": "sha256=0"}),
        api.post("/webhooks/partner", data=body),  # unsigned
        api.post("/webhooks/nobody", data=body, headers=headers),
        api.post(
            "/webhooks/partner",
            data=broken,
            headers={
                "Content-Type": "application/json",
                "X-Signature": "sha256=" + hmac_hex(broken),
            },
        ),
        api.post(
            "/webhooks/partner",
            data=keyless,
            headers={
                "Content-Type": "application/json",
                "X-Signature": "sha256=" + hmac_hex(keyless),
            },
        ),
        api.post("/webhooks/partner", data=TOO_LARGE, headers=headers),
    ]
    handshakes = [
        api.options("/webhooks/ce", headers={"WebHook-Request-Origin": "eventgrid.azure.net"}),
        api.options("/webhooks/ce", headers={"WebHook-Request-Origin": "a b"}),
        api.options("/webhooks/partner"),
    ]
    return [("/webhooks/{source}", "post", r) for r in answers] + [
        ("/webhooks/{source}", "options", r) for r in handshakes
    ]


def _other_answers(api: FlaskClient) -> list[Answer]:
    return [
        ("/healthz", "get", api.get("/healthz")),
        ("/readyz", "get", api.get("/readyz")),
        ("/metrics", "get", api.get("/metrics", headers=bearer("metrics-token-0123"))),
        ("/metrics", "get", api.get("/metrics")),
        ("/metrics", "get", api.get("/metrics", headers=bearer("not-the-token"))),
        ("/problems", "get", api.get("/problems")),
        ("/problems/{slug}", "get", api.get("/problems/not-found")),
        ("/problems/{slug}", "get", api.get("/problems/no-such-problem")),
        ("/openapi.json", "get", api.get("/openapi.json")),
    ]


def _down_answers(down: FlaskClient) -> list[Answer]:
    body, headers = _signed({"id": "evt-9", "type": "demo"})
    return [
        ("/api/events", "post", post_event(down, "k-down", EVENT)),
        ("/api/events/{id}", "get", down.get("/api/events/1", headers=bearer())),
        ("/webhooks/{source}", "post", down.post("/webhooks/partner", data=body, headers=headers)),
        ("/readyz", "get", down.get("/readyz")),
    ]


@pytest.fixture
def answers(api, make_app, db_url, tmp_path) -> list[Answer]:
    """Every answer above, the database-away ones from an app whose database is gone."""
    if db_url.startswith("sqlite"):
        gone = f"sqlite:///{tmp_path / 'missing-dir' / 'db.sqlite3'}"
    else:
        gone = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"
    down_app = make_app({"clients": CLIENTS, "sources": SOURCES}, SQLALCHEMY_DATABASE_URI=gone)
    down_app.test_client_class = RecordingClient
    down = down_app.test_client()
    collected = [
        *_api_answers(api),
        *_webhook_answers(api),
        *_other_answers(api),
        *_down_answers(down),
    ]
    statuses = sorted({r.status_code for _, _, r in collected})
    # The refusals this file is about were really provoked.
    assert {400, 401, 404, 413, 415, 422, 503} <= set(statuses), statuses
    return collected


def _documented(doc: dict[str, Any], path: str, method: str, status: int) -> dict[str, Any]:
    responses = doc["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path}: {status} is not documented"
    return responses[str(status)]


def _label(path: str, method: str, response: Any) -> str:
    return f"{method.upper()} {path} -> {response.status_code} {response.get_data()[:120]!r}"


def test_every_answer_validates_against_the_document(spec, answers):
    for path, method, response in answers:
        try:
            checked(spec, response, request_too=False)
        except Exception as exc:  # pragma: no cover - the message is the point
            raise AssertionError(f"{_label(path, method, response)}: {exc!r}") from exc


HEADERS = [
    "Location",
    "Idempotent-Replayed",
    "Retry-After",
    "WWW-Authenticate",
    "Allow",
    "WebHook-Allowed-Origin",
    "X-Request-Id",
]


@pytest.mark.parametrize("header", HEADERS)
def test_every_header_an_answer_carries_is_documented_for_it(api, answers, header):
    doc = api.get("/openapi.json").get_json()
    missing = [
        _label(path, method, response)
        for path, method, response in answers
        if header in response.headers
        and header.lower()
        not in {
            name.lower()
            for name in _documented(doc, path, method, response.status_code).get("headers", {})
        }
    ]
    assert not missing, f"{header} sent but not documented:\n" + "\n".join(missing)


def test_every_member_of_a_problem_is_documented(api, answers):
    doc = api.get("/openapi.json").get_json()
    members = set(doc["components"]["schemas"]["Problem"]["properties"])
    undocumented = [
        f"{_label(path, method, response)}: {sorted(set(response.get_json()) - members)}"
        for path, method, response in answers
        if response.mimetype == PROBLEM_JSON and set(response.get_json()) - members
    ]
    assert not undocumented, "\n".join(undocumented)


def _unpromised(doc: dict[str, Any], answers: list[Answer]) -> list[str]:
    """Headers every answer of an operation's status carries, not marked required for it."""
    groups: dict[tuple[str, str, int], list[Any]] = {}
    for path, method, response in answers:
        groups.setdefault((path, method, response.status_code), []).append(response)
    components = doc["components"]["headers"]
    unpromised = []
    for (path, method, status), responses in groups.items():
        documented = {
            name.lower(): components[h["$ref"].rsplit("/", 1)[1]] if "$ref" in h else h
            for name, h in _documented(doc, path, method, status).get("headers", {}).items()
        }
        for header in HEADERS:
            always = all(header in response.headers for response in responses)
            if always and not documented.get(header.lower(), {}).get("required"):
                unpromised.append(f"{method.upper()} {path} {status}: {header}")
    return unpromised


def test_a_header_every_such_answer_carries_is_required_in_the_document(api, answers):
    # A generated client types an optional header as maybe absent: one the
    # receiver always sends (Retry-After on a 503, Location on a 201) is promised.
    unpromised = _unpromised(api.get("/openapi.json").get_json(), answers)
    assert not unpromised, "\n".join(unpromised)


def test_a_key_in_flight_is_the_documented_409(spec, api, make_app, db_url):
    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite has no lock per key: a writer waits for the database (busy timeout)")
    app = make_app({"clients": CLIENTS}, IDEMPOTENCY_LOCK_TIMEOUT_SECONDS=0.05)
    app.test_client_class = RecordingClient
    pool = ThreadPoolExecutor(1)
    with StatementGate(db_url) as gate:
        first = pool.submit(post_event, app.test_client(), "in-flight", EVENT)
        assert wait_until(lambda: lock_waits(db_url) == 1, timeout=20)
        # The first holds its uncommitted record for as long as this takes.
        waited = post_event(app.test_client(), "in-flight", EVENT)
        gate.release()
        assert first.result(20).status_code == 201
    pool.shutdown()
    assert waited.get_json()["type"] == "/problems/idempotency-key-in-use"
    checked(spec, waited, request_too=False)
    answer = [("/api/events", "post", waited)]
    assert not _unpromised(api.get("/openapi.json").get_json(), answer)


_EVENTS_TAKEN = [
    {"type": "t", "data": None},
    {"type": "\u00e9" * 255, "data": 1},
    {"type": "a\u0001b", "data": "a\u0000b"},
]
_EVENTS_REFUSED = [
    {"type": "", "data": 1},
    {"type": "x" * 256, "data": 1},
    {"type": "a\u0000b", "data": 1},
    {"type": 7, "data": 1},
    {"type": "t"},
    {"data": 1},
]


def test_the_documented_event_is_the_one_the_server_takes(spec, api):
    # An event the document allows is one the server stores, and one it
    # refuses as invalid-event breaks the document.
    for i, event in enumerate(_EVENTS_TAKEN):
        response = post_event(api, f"taken-{i}", event)
        assert response.status_code == 201, event
        assert _request_is_valid(spec, response), event
    for i, event in enumerate(_EVENTS_REFUSED):
        response = post_event(api, f"refused-{i}", event)
        assert response.get_json()["type"] == "/problems/invalid-event", event
        assert not _request_is_valid(spec, response), event
