from __future__ import annotations

import json
import time

import pytest
import stripe

from webhook_receiver.webhooks.providers import (
    MissingKeyError,
    PayloadError,
    SignatureError,
    StripeProvider,
    TimestampError,
)

from ...helpers.signing import hmac_hex, inbound, source, stripe_signature

P = StripeProvider()
SECRET = "whsec_test_secret_new"
OLD_SECRET = "whsec_test_secret_old"
T = 1_700_000_000
BODY = json.dumps(
    {"id": "evt_1NG8Du2eZvKYlo2CUI79vXWy", "object": "event", "type": "charge.succeeded"}
)
SRC = source("stripe", SECRET)


def delivery(header: str | None, body: str = BODY, now: float = T):
    return inbound(body, {"Stripe-Signature": header} if header is not None else {}, now=now)


def test_accepts_header_generated_by_stripe_sdk() -> None:
    header = stripe.WebhookSignature.generate_signature_header(BODY, SECRET, timestamp=T)
    P.verify(delivery(header), SRC)
    assert header == stripe_signature(BODY, SECRET, T)


def test_stripe_sdk_accepts_what_we_sign() -> None:
    now = int(time.time())
    header = stripe_signature(BODY, SECRET, now)
    assert stripe.WebhookSignature.verify_header(BODY, header, SECRET, tolerance=300) is True
    event = stripe.Webhook.construct_event(BODY, header, SECRET)
    assert event.id == "evt_1NG8Du2eZvKYlo2CUI79vXWy"
    P.verify(delivery(header, now=now), SRC)


def test_identify() -> None:
    ident = P.identify(delivery(stripe_signature(BODY, SECRET, T)), SRC)
    assert ident.dedup_key == "evt_1NG8Du2eZvKYlo2CUI79vXWy"
    assert ident.event_type == "charge.succeeded"
    assert ident.immediate_response is None


def test_retry_resigned_with_new_timestamp_keeps_the_key() -> None:
    first = delivery(stripe_signature(BODY, SECRET, T), now=T)
    retry = delivery(stripe_signature(BODY, SECRET, T + 3600), now=T + 3601)
    assert first.headers["Stripe-Signature"] != retry.headers["Stripe-Signature"]
    P.verify(first, SRC)
    P.verify(retry, SRC)
    assert P.identify(first, SRC).dedup_key == P.identify(retry, SRC).dedup_key


@pytest.mark.parametrize("signer", [SECRET, OLD_SECRET])
def test_rotation_either_secret(signer: str) -> None:
    P.verify(delivery(stripe_signature(BODY, signer, T)), source("stripe", OLD_SECRET, SECRET))


def test_rotation_any_v1_matches() -> None:
    # While a secret rolls, Stripe sends one v1 per active secret.
    header = (
        stripe_signature(BODY, "whsec_unknown", T)
        + ",v1="
        + hmac_hex(f"{T}.{BODY}".encode(), SECRET)
    )
    P.verify(delivery(header), SRC)


def test_wrong_secret_rejected() -> None:
    with pytest.raises(SignatureError, match="signature does not match"):
        P.verify(delivery(stripe_signature(BODY, OLD_SECRET, T)), SRC)


def test_tampered_body_rejected() -> None:
    header = stripe_signature(BODY, SECRET, T)
    with pytest.raises(SignatureError) as exc:
        P.verify(delivery(header, body=BODY.replace("charge", "refund")), SRC)
    assert type(exc.value) is SignatureError


@pytest.mark.parametrize("now", [T + 300, T - 300, T])
def test_boundary_accepted(now: int) -> None:
    P.verify(delivery(stripe_signature(BODY, SECRET, T), now=now), SRC)


@pytest.mark.parametrize("now", [T + 301, T - 301, T + 86400])
def test_stale_and_future_rejected(now: int) -> None:
    with pytest.raises(TimestampError):
        P.verify(delivery(stripe_signature(BODY, SECRET, T), now=now), SRC)


def test_custom_tolerance() -> None:
    src = source("stripe", SECRET, tolerance_seconds=10)
    P.verify(delivery(stripe_signature(BODY, SECRET, T), now=T + 10), src)
    with pytest.raises(TimestampError):
        P.verify(delivery(stripe_signature(BODY, SECRET, T), now=T + 11), src)


def test_missing_header() -> None:
    with pytest.raises(SignatureError, match="missing Stripe-Signature header"):
        P.verify(delivery(None), SRC)


@pytest.mark.parametrize(
    "header",
    [
        "garbage",
        f"v1={hmac_hex(b'x', SECRET)}",  # no t
        f"t={T},t={T},v1={hmac_hex(b'x', SECRET)}",  # two t
        f"t=abc,v1={hmac_hex(b'x', SECRET)}",
        f"t=-{T},v1={hmac_hex(b'x', SECRET)}",
        f"t={T}",  # no v1
        f"t={T},v0={hmac_hex(f'{T}.{BODY}'.encode(), SECRET)}",  # only the test scheme
        f"t={T},v1=nothex",
    ],
)
def test_malformed_header(header: str) -> None:
    with pytest.raises(SignatureError) as exc:
        P.verify(delivery(header), SRC)
    assert type(exc.value) is SignatureError
    assert SECRET not in str(exc.value)


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"type": "x"}, MissingKeyError),
        ({"id": 12, "type": "x"}, MissingKeyError),
        ({"id": "", "type": "x"}, MissingKeyError),
        ({"id": "e" * 513}, MissingKeyError),
        ([1, 2], PayloadError),
    ],
)
def test_identify_errors(payload: object, error: type[Exception]) -> None:
    body = json.dumps(payload)
    with pytest.raises(error):
        P.identify(delivery(stripe_signature(body, SECRET, T), body=body), SRC)


def test_identify_non_json_body() -> None:
    with pytest.raises(PayloadError):
        P.identify(delivery("x", body="not json"), SRC)
