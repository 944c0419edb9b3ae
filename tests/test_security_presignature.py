"""An unsigned delivery costs the receiver a signature check, not a JSON parse.

The receipt parsed the body before it checked the signature: anyone could
post a body just under the limit that is slow to parse (about a million
brackets: a second of CPU for one request, against milliseconds for the
HMAC), and a few such requests a second held every gunicorn worker. The
signature is checked first now; only an authentic body is parsed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from flask import Flask

from webhook_receiver.webhooks import receipt

from .helpers import post_webhook
from .helpers import signing as s

LIMIT = 1024 * 1024
# Nested arrays, each 250 deep (inside MAX_DEPTH): valid JSON, every byte a bracket or a comma.
_NESTED = b"[" * 250 + b"]" * 250
SLOW = b"[" + b",".join([_NESTED] * ((LIMIT - 100) // (len(_NESTED) + 1))) + b"]"
# As long, but one string: quick to parse.
FLAT = b'{"x":"' + b"a" * (len(SLOW) - 8) + b'"}'


@pytest.fixture
def app(make_app) -> Flask:
    return make_app({"sources": s.SOURCES}, MAX_BODY_BYTES=LIMIT)


def test_a_forged_delivery_is_refused_before_its_body_is_parsed(app: Flask, monkeypatch) -> None:
    # Counted at the receipt's one parse (called through, not replaced): a
    # forged body, however slow to parse, is refused on its signature alone.
    parsed: list[int] = []
    parse = receipt._parse

    def counted(body: bytes, *args: Any) -> Any:
        parsed.append(len(body))
        return parse(body, *args)

    monkeypatch.setattr(receipt, "_parse", counted)
    client = app.test_client()
    forged = {
        "Content-Type": "application/json",
        "Stripe-Signature": f"t={int(time.time())},v1={'0' * 64}",
    }
    for body in (SLOW, FLAT):
        response = post_webhook(client, "stripe-live", body, forged)
        assert response.status_code == 401, response.get_data(as_text=True)
        assert response.json["type"] == "/problems/signature-invalid"
    # Parsed first, the slow body took about 0.8 s of CPU, the HMAC 10 ms.
    assert parsed == []
    signed = {"Content-Type": "application/json", **s.stripe_signed(FLAT, int(time.time()))}
    post_webhook(client, "stripe-live", FLAT, signed)
    assert parsed == [len(FLAT)]  # the count does see a parse


def test_an_authentic_body_is_still_parsed_and_judged(app: Flask) -> None:
    client = app.test_client()
    # Signed, the slow body is read: valid JSON, but no Stripe event (an object).
    headers = {"Content-Type": "application/json", **s.stripe_signed(SLOW, int(time.time()))}
    response = post_webhook(client, "stripe-live", SLOW, headers)
    assert response.status_code == 400
    assert response.json["type"] == "/problems/payload-invalid"
    assert "not a JSON object" in response.json["detail"]
    # And a signed body that is no JSON at all is refused as such.
    headers = {"Content-Type": "application/json", **s.stripe_signed(b"{", int(time.time()))}
    response = post_webhook(client, "stripe-live", b"{", headers)
    assert response.status_code == 400
    assert response.json["type"] == "/problems/payload-invalid"
    body, headers = s.stripe_delivery({"id": "evt_1", "type": "charge.succeeded"})
    assert post_webhook(client, "stripe-live", body, headers).status_code == 200
