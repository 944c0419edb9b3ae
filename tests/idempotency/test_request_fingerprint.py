"""The Idempotency-Key fingerprint covers the path: one key and body on two paths is a mismatch."""

from __future__ import annotations

from webhook_receiver.fingerprint import fingerprint
from webhook_receiver.idempotency.decorator import request_fingerprint
from webhook_receiver.models import IdempotencyRecord

from ..conftest import bearer
from ..helpers import count, post_event
from .test_idempotent import make_test_blueprint


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
    assert count(app, IdempotencyRecord) == 1


def test_queries_that_differ_in_bytes_that_are_not_utf8_are_a_mismatch(app, client) -> None:
    # %FF and %FE are different bytes, and request.args keeps them apart
    # ('%FF', '%FE'); decoded as UTF-8 both were U+FFFD, one fingerprint.
    first = post_event(client, key="q-key", path="/api/events?tag=%FF")
    assert first.status_code == 201, first.get_data(as_text=True)
    other = post_event(client, key="q-key", path="/api/events?tag=%FE")
    assert other.status_code == 422, other.get_data(as_text=True)
    assert other.get_json()["type"] == "/problems/idempotency-key-reused"
    # The same bytes, whatever the case of the escape, are the same request.
    again = post_event(client, key="q-key", path="/api/events?tag=%ff")
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert count(app) == 1


def test_the_same_bytes_sent_as_another_media_type_are_a_mismatch(app, client) -> None:
    # A JSON event, then its canonical bytes as text/plain (not JSON, which
    # the view refuses): another request, not a retry to replay the 201 to.
    body = b'{"data":{"order":42},"type":"order.created"}'
    first = post_event(client, key="ct-key", body=body)
    assert first.status_code == 201, first.get_data(as_text=True)
    other = post_event(client, key="ct-key", body=body, content_type="text/plain")
    assert other.status_code == 422, other.get_data(as_text=True)
    assert other.get_json()["type"] == "/problems/idempotency-key-reused"
    # JSON re-serialised, or sent with a charset, is still the same request.
    again = post_event(
        client,
        key="ct-key",
        body=b'{"type": "order.created", "data": {"order": 42}}',
        content_type="application/json; charset=utf-8",
    )
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert count(app) == 1


def test_a_body_that_is_not_json_is_fingerprinted_with_its_media_type(make_app) -> None:
    app = make_app(PROPAGATE_EXCEPTIONS=False)
    app.register_blueprint(make_test_blueprint())
    client = app.test_client()
    headers = {**bearer(), "Idempotency-Key": "form-key"}
    first = client.post("/t/ok", data=b"a=1", headers=headers, content_type="text/plain")
    assert first.status_code == 201
    form = "application/x-www-form-urlencoded"
    other = client.post("/t/ok", data=b"a=1", headers=headers, content_type=form)
    assert other.status_code == 422, other.get_data(as_text=True)
    again = client.post("/t/ok", data=b"a=1", headers=headers, content_type="Text/Plain")
    assert again.headers["Idempotent-Replayed"] == "true"


def test_fingerprints_saved_before_media_types_counted_still_match(make_app) -> None:
    # Records outlive a deploy: a retry sent across it must find its record.
    # A JSON body and no body at all fingerprint as they did before a body's
    # media type counted; only a body that is not JSON has its type added.
    app = make_app()
    with app.test_request_context("/t/ok?b=2&a=1", method="POST"):
        assert request_fingerprint() == fingerprint(["POST", "/t/ok", "a=1&b=2", b""])
    with app.test_request_context(
        "/t/ok", method="POST", data=b'{"b": 1, "a": 2}', content_type="application/json"
    ):
        assert request_fingerprint() == fingerprint(["POST", "/t/ok", "", b'{"a":2,"b":1}'])
    with app.test_request_context("/t/ok", method="POST", data=b"a=1", content_type="text/plain"):
        assert request_fingerprint() == fingerprint(["POST", "/t/ok", "", b"a=1", "text/plain"])
