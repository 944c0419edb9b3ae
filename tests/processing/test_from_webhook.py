"""From a signed webhook to its consumers: the receipt writes the outbox rows itself.

On PostgreSQL the receipt is one statement whose CTEs also insert the new
event's deliveries; on SQLite it is the event insert followed by the outbox
insert in the same transaction. Both must give the same rows.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from ..helpers.signing import hmac_hex
from .conftest import FAST, SOURCE, config_with, delivery_rows, drain, forward

SECRET = "shop-secret-0123456789"


def signed(payload: dict, key: str) -> tuple[bytes, dict[str, str]]:
    body = json.dumps(payload).encode()
    return body, {
        "Content-Type": "application/json",
        "X-Signature": f"sha256={hmac_hex(body, SECRET)}",
        "Idempotency-Key": key,
    }


def _app(make_app, downstream):
    forwards = [
        forward("billing", downstream.url + "/billing"),
        forward("audit", downstream.url + "/audit", event_types=["thing.deleted"]),
    ]
    config = config_with(forwards)
    config["sources"][SOURCE]["event_type"] = "json:/type"
    return make_app(config, **FAST)


def test_a_webhook_gets_one_delivery_per_matching_consumer(make_app, downstream):
    app = _app(make_app, downstream)
    client = app.test_client()
    body, headers = signed({"type": "thing.created", "id": 1}, "k-1")
    first = client.post(f"/webhooks/{SOURCE}", data=body, headers=headers)
    assert first.status_code == 200
    event_id = first.get_json()["event_id"]
    # a redelivery adds no work
    again = client.post(f"/webhooks/{SOURCE}", data=body, headers=headers)
    assert again.headers["Idempotent-Replayed"] == "true"
    body2, headers2 = signed({"type": "thing.deleted", "id": 1}, "k-2")
    second = client.post(f"/webhooks/{SOURCE}", data=body2, headers=headers2)
    rows = sorted((r["event_id"], r["consumer"], r["kind"], r["state"]) for r in delivery_rows(app))
    assert rows == sorted(
        [
            (event_id, "billing", "forward", "pending"),
            (second.get_json()["event_id"], "billing", "forward", "pending"),
            (second.get_json()["event_id"], "audit", "forward", "pending"),
        ]
    )


def test_a_webhook_reaches_its_downstream_with_a_stable_key(
    make_app, downstream, clock, make_worker
):
    app = _app(make_app, downstream)
    body, headers = signed({"type": "thing.created", "id": 7}, "k-7")
    assert (
        app.test_client().post(f"/webhooks/{SOURCE}", data=body, headers=headers).status_code == 200
    )
    # The worker's clock is past the receipt's (stamped with the real time,
    # however long the set-up took on a busy machine).
    clock.now = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    (call,) = downstream.calls_to("/billing")
    assert call.body == body
    assert call.headers["Idempotency-Key"] == f"billing:{SOURCE}:k-7"
