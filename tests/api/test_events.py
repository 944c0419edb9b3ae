"""POST /api/events and GET /api/events/<id> under the Idempotency-Key engine."""

from __future__ import annotations

from webhook_receiver.extensions import db
from webhook_receiver.models import Event, IdempotencyRecord

from ..conftest import GLOBEX_TOKEN, bearer
from ..helpers import count, post_event


def test_create_event_stores_and_answers_201(app, client):
    response = post_event(client)
    assert response.status_code == 201
    doc = response.get_json()
    assert doc["type"] == "order.created"
    assert doc["data"] == {"order": 42}
    assert doc["source"] == "api:acme"
    assert doc["received_at"].endswith("Z")
    assert response.headers["Location"] == f"/api/events/{doc['id']}"
    assert "Idempotent-Replayed" not in response.headers
    with app.app_context():
        event = db.session.get(Event, doc["id"])
        assert event.client == "acme"
        assert event.event_type == "order.created"
        assert dict(event.headers)["Authorization"] == "[redacted]"


def test_retry_with_same_key_replays_the_saved_response(app, client):
    first = post_event(client)
    second = post_event(client)
    assert second.status_code == 201
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.get_json() == first.get_json()
    assert second.headers["Location"] == first.headers["Location"]
    assert second.headers["Content-Type"] == "application/json"
    assert count(app) == 1


def test_reserialised_json_retry_is_a_replay_not_a_conflict(app, client):
    post_event(client, body='{"type": "order.created", "data": {"a": 1, "b": 2}}')
    again = post_event(client, body='{"data":{"b":2,"a":1},\n "type":"order.created"}')
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert count(app) == 1


def test_same_key_different_body_is_422_and_executes_nothing(app, client):
    post_event(client)
    response = post_event(client, body={"type": "order.created", "data": {"order": 43}})
    assert response.status_code == 422
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == "/problems/idempotency-key-reused"
    assert count(app) == 1


def test_same_key_different_path_query_is_a_mismatch(app, client):
    post_event(client)
    response = post_event(client, query_string={"x": "1"})
    assert response.status_code == 422


def test_keys_are_scoped_per_client(app, client):
    a = post_event(client)
    b = post_event(client, token=GLOBEX_TOKEN)
    assert a.status_code == b.status_code == 201
    assert "Idempotent-Replayed" not in b.headers
    assert a.get_json()["id"] != b.get_json()["id"]
    assert b.get_json()["source"] == "api:globex"
    assert count(app) == 2
    assert count(app, IdempotencyRecord) == 2
    # and a body different from A's under the same key is fine for B
    c = post_event(client, token=GLOBEX_TOKEN, body={"type": "x", "data": None}, key="key-2")
    assert c.status_code == 201


def test_missing_token_is_401_problem(app, client):
    response = client.post(
        "/api/events", json={"type": "t", "data": 1}, headers={"Idempotency-Key": "k"}
    )
    assert response.status_code == 401
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == "/problems/unauthorized"
    assert "Bearer" in response.headers["WWW-Authenticate"]
    bad = post_event(client, token="not-a-real-token-at-all")
    assert bad.status_code == 401
    assert count(app) == 0


def test_missing_idempotency_key_is_400(app, client):
    response = client.post("/api/events", json={"type": "t", "data": 1}, headers=bearer())
    assert response.status_code == 400
    assert response.get_json()["type"] == "/problems/idempotency-key-missing"
    assert count(app) == 0


def test_malformed_idempotency_keys_are_400(app, client):
    for key in ["", "x" * 256, "caf\u00e9", "a\x01b", '"unterminated', '"a" junk', "a,b"]:
        response = post_event(client, key=key)
        assert response.status_code == 400, key
        assert response.get_json()["type"] in (
            "/problems/idempotency-key-invalid",
            "/problems/idempotency-key-missing",
        ), key
    assert count(app) == 0
    assert count(app, IdempotencyRecord) == 0


def test_idempotency_key_sent_twice_is_400(app, client):
    response = client.post(
        "/api/events",
        json={"type": "t", "data": 1},
        headers=[*bearer().items(), ("Idempotency-Key", "a"), ("Idempotency-Key", "b")],
    )
    assert response.status_code == 400
    assert response.get_json()["type"] == "/problems/idempotency-key-invalid"


def test_quoted_sf_string_key_equals_its_bare_form(app, client):
    first = post_event(client, key='"order-\\"7\\""')
    assert first.status_code == 201
    again = post_event(client, key='order-"7"')
    assert again.headers["Idempotent-Replayed"] == "true"
    assert post_event(client, key="x" * 255).status_code == 201


def test_a_body_not_sent_as_json_is_415_and_binds_no_key(app, client):
    response = post_event(client, body=b"not json", content_type="text/plain")
    assert response.status_code == 415
    problem = response.get_json()
    assert problem["type"] == "/problems/unsupported-media-type"
    assert "application/json" in problem["detail"]
    assert count(app) == count(app, IdempotencyRecord) == 0
    # Refused before the view began: the corrected request under the key is created.
    assert post_event(client).status_code == 201
    assert post_event(client).headers["Idempotent-Replayed"] == "true"
    assert count(app) == 1


def test_invalid_json_variants_are_400(app, client):
    bodies = [b"{", b"\xff\xfe{}", b'{"type": NaN, "data": 1}', b"[" * 5000 + b"]" * 5000]
    for i, body in enumerate(bodies):
        response = post_event(client, key=f"bad-{i}", body=body)
        assert response.status_code == 400, body[:20]
        assert response.get_json()["type"] == "/problems/invalid-json"
    assert count(app) == count(app, IdempotencyRecord) == 0


def test_missing_or_non_string_type_is_400(app, client):
    for i, body in enumerate([{"data": 1}, {"type": 5, "data": 1}, {"type": "t"}, [1, 2]]):
        response = post_event(client, key=f"k{i}", body=body)
        assert response.status_code == 400
        assert response.get_json()["type"] == "/problems/invalid-event"
    assert count(app) == count(app, IdempotencyRecord) == 0


def test_body_over_the_limit_is_413(make_app):
    app = make_app(MAX_BODY_BYTES=1000)
    client = app.test_client()
    response = post_event(client, body={"type": "big", "data": "x" * 2000})
    assert response.status_code == 413
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == "/problems/payload-too-large"
    assert count(app) == 0
    assert count(app, IdempotencyRecord) == 0


def test_get_event_for_its_client_only(app, client):
    created = post_event(client).get_json()
    mine = client.get(f"/api/events/{created['id']}", headers=bearer())
    assert mine.status_code == 200
    assert mine.get_json()["data"] == {"order": 42}
    assert mine.get_json()["id"] == created["id"]
    theirs = client.get(f"/api/events/{created['id']}", headers=bearer(GLOBEX_TOKEN))
    assert theirs.status_code == 404
    assert theirs.mimetype == "application/problem+json"
    missing = client.get("/api/events/999999", headers=bearer())
    assert missing.status_code == 404
    assert client.get(f"/api/events/{created['id']}").status_code == 401


def test_machine_endpoints_never_use_a_session_cookie(app, client):
    """Only /admin has sessions: the API reads no cookie and sets none."""
    client.set_cookie("session", "not-a-valid-signed-session")
    response = post_event(client)
    assert response.status_code == 201
    assert "Set-Cookie" not in response.headers
    assert "Vary" not in response.headers or "Cookie" not in response.headers["Vary"]


def test_the_event_keeps_the_key_the_record_is_under_not_the_header_as_sent(app, client):
    # The draft's sf-string form and a bare token with spaces around it name
    # the key inside: the event's meta (what the admin searches and shows)
    # holds that key, as the idempotency record does, not the header's text.
    quoted = post_event(client, key='"order-\\"7\\""')
    spaced = post_event(client, key=" order-8 ", body={"type": "t", "data": 8})
    assert quoted.status_code == spaced.status_code == 201
    with app.app_context():
        keys = {
            event.meta["idempotency_key"]
            for event in db.session.scalars(db.select(Event).order_by(Event.id))
        }
        records = set(db.session.scalars(db.select(IdempotencyRecord.key)))
    assert keys == records == {'order-"7"', "order-8"}


def test_a_refused_idempotency_key_is_told_what_is_wrong_with_it(app, client):
    # A server cannot tell a key sent twice from one holding a comma (it
    # joins repeats with commas), but a client that sent one key must not
    # be told it sent two: the detail names the comma and the way to send it.
    cases = {
        "order,7": "comma",
        '"order-7" x': "after the closing quote",
    }
    for key, said in cases.items():
        response = post_event(client, key=key)
        assert response.status_code == 400, key
        problem = response.get_json()
        assert problem["type"] == "/problems/idempotency-key-invalid", key
        assert said in problem["detail"], (key, problem["detail"])
    # A key with a comma is sent quoted, as the draft's sf-string.
    assert post_event(client, key='"order,7"').status_code == 201
    assert count(app, IdempotencyRecord) == 1
