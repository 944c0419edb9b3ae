"""Paddle Billing, checked against Paddle's own Python SDK (paddle-python-sdk)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest
from paddle_billing.Notifications import Secret, Verifier

from webhook_receiver.webhooks.providers import (
    MissingKeyError,
    PaddleProvider,
    SignatureError,
    TimestampError,
)

from ...helpers.signing import inbound, paddle_h1, source

P = PaddleProvider()
SECRET = "pdl_ntfset_01gkpjp8bkm3tm53kdgkx6sms7_6h3qd3uFSi9YCD3OLYAShQI90XTI6vEY"
# The shape of Paddle's documented "transaction.created" notification.
EVENT = {
    "event_id": "evt_01h8bzakzx3hm2fmen703n5q45",
    "event_type": "transaction.created",
    "occurred_at": "2023-08-21T11:57:47.390028Z",
    "notification_id": "ntf_01h8bzam1z32agrxjwhjgqk8w6",
    "data": {"id": "txn_01h8bzakzx3hm2fmen703n5q45", "status": "draft"},
}
BODY = json.dumps(EVENT)


@dataclass
class _Request:
    """What the SDK's Verifier reads: a body and headers."""

    body: bytes
    headers: dict[str, str]


def test_paddle_sdk_accepts_what_is_received() -> None:
    now = int(time.time())
    header = f"ts={now};h1={paddle_h1(BODY, SECRET, now)}"
    assert Verifier().verify(_Request(BODY.encode(), {"Paddle-Signature": header}), Secret(SECRET))
    P.verify(inbound(BODY, {"Paddle-Signature": header}, now=now), source("paddle", SECRET))


def test_paddle_sdk_refuses_what_is_refused() -> None:
    now = int(time.time())
    header = f"ts={now};h1={paddle_h1(BODY, 'another', now)}"
    with pytest.raises(ConnectionRefusedError):
        Verifier().verify(_Request(BODY.encode(), {"Paddle-Signature": header}), [Secret(SECRET)])
    with pytest.raises(SignatureError, match="signature does not match"):
        P.verify(inbound(BODY, {"Paddle-Signature": header}, now=now), source("paddle", SECRET))


def test_rotation_two_h1_values() -> None:
    # While a secret is rotated Paddle signs with both, one h1 each.
    old, new = paddle_h1(BODY, "old", 1700000000), paddle_h1(BODY, SECRET, 1700000000)
    header = f"ts=1700000000;h1={old};h1={new}"
    P.verify(inbound(BODY, {"Paddle-Signature": header}), source("paddle", SECRET))


@pytest.mark.parametrize("offset", [-301, 301])
def test_stale_and_future_refused(offset: int) -> None:
    ts = 1700000000 + offset
    d = inbound(BODY, {"Paddle-Signature": f"ts={ts};h1={paddle_h1(BODY, SECRET, ts)}"})
    with pytest.raises(TimestampError):
        P.verify(d, source("paddle", SECRET))


@pytest.mark.parametrize(
    "header",
    [
        "",
        "h1=" + "00" * 32,
        "ts=1700000000",
        "ts=1700000000;ts=1700000000;h1=00",
        "ts=x;h1=00",
        "tsh1",
    ],
)
def test_malformed_headers(header: str) -> None:
    with pytest.raises(SignatureError):
        P.verify(inbound(BODY, {"Paddle-Signature": header}), source("paddle", SECRET))


def test_identify_event_id_is_the_key() -> None:
    ident = P.identify(inbound(BODY), source("paddle", SECRET))
    assert ident.dedup_key == "evt_01h8bzakzx3hm2fmen703n5q45"
    assert ident.event_type == "transaction.created"
    assert ident.meta == {"paddle_notification_id": "ntf_01h8bzam1z32agrxjwhjgqk8w6"}


def test_identify_without_event_id() -> None:
    with pytest.raises(MissingKeyError):
        P.identify(inbound(json.dumps({"notification_id": "ntf_1"})), source("paddle", SECRET))
