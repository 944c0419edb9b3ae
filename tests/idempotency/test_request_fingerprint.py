"""The Idempotency-Key fingerprint covers the path: one key and body on two paths is a mismatch."""

from __future__ import annotations

from webhook_receiver.models import IdempotencyRecord

from ..conftest import bearer
from ..helpers import count
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
