from __future__ import annotations

import base64
import json
import time
from datetime import UTC, datetime

import pytest
import standardwebhooks.webhooks
import svix.webhooks

from webhook_receiver.webhooks.providers import (
    MissingKeyError,
    SignatureError,
    StandardProvider,
    TimestampError,
)

from ...helpers.signing import hmac_digest, inbound, source

P = StandardProvider()

# The published vector, identical in standard-webhooks/standard-webhooks
# libraries/python/tests/test_webhooks.py (test_sign_function) and
# svix/svix-webhooks python/tests/test_webhooks.py (test_sign_function).
VEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VEC_TS = 1614265330
VEC_PAYLOAD = '{"test": 2432232314}'
VEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
# The tests' "invalid signature" differs from the vector in its last base64 character.
VEC_BAD_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OA="

SECRET = "whsec_" + base64.b64encode(b"a new 24 byte secret key").decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"the old 24 byte secret!!").decode()
BODY = json.dumps({"type": "invoice.paid", "data": {"id": 7}})
T = 1_700_000_000


def our_sign(secret: str, msg_id: str, ts: int, body: str) -> str:
    """Sign per the Standard Webhooks spec, independently of any library."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    return "v1," + base64.b64encode(hmac_digest(f"{msg_id}.{ts}.{body}", key)).decode()


def headers(msg_id: str, ts: int, sig: str, family: str = "webhook") -> dict[str, str]:
    return {f"{family}-id": msg_id, f"{family}-timestamp": str(ts), f"{family}-signature": sig}


def vector(family: str, sig: str = VEC_SIGNATURE):
    return inbound(VEC_PAYLOAD, headers(VEC_ID, VEC_TS, sig, family), now=VEC_TS)


@pytest.mark.parametrize("family", ["webhook", "svix"])
def test_published_vector(family: str) -> None:
    P.verify(vector(family), source("standard", VEC_SECRET))
    ident = P.identify(vector(family), source("standard", VEC_SECRET))
    assert (ident.dedup_key, ident.event_type) == (VEC_ID, None)


def test_published_vector_unprefixed_secret() -> None:
    P.verify(vector("webhook"), source("standard", VEC_SECRET.removeprefix("whsec_")))


def test_our_signer_reproduces_the_vector() -> None:
    assert our_sign(VEC_SECRET, VEC_ID, VEC_TS, VEC_PAYLOAD) == VEC_SIGNATURE


@pytest.mark.parametrize("family", ["webhook", "svix"])
def test_published_invalid_signature(family: str) -> None:
    with pytest.raises(SignatureError, match="signature does not match"):
        P.verify(vector(family, VEC_BAD_SIGNATURE), source("standard", VEC_SECRET))


def test_published_multi_signature_header() -> None:
    # As in the libraries' test_multi_sig_payload_is_valid.
    sig = " ".join(
        [
            "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc=",
            "v2,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc=",
            VEC_SIGNATURE,
            "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc=",
        ]
    )
    P.verify(vector("webhook", sig), source("standard", VEC_SECRET))


@pytest.mark.parametrize("lib", [standardwebhooks.webhooks.Webhook, svix.webhooks.Webhook])
def test_accepts_library_signatures(lib: type) -> None:
    sig = lib(SECRET).sign("msg_1", datetime.fromtimestamp(T, UTC), BODY)
    family = "svix" if lib is svix.webhooks.Webhook else "webhook"
    P.verify(inbound(BODY, headers("msg_1", T, sig, family), now=T), source("standard", SECRET))


def test_libraries_accept_what_we_sign() -> None:
    now = int(time.time())
    sig = our_sign(SECRET, "msg_2", now, BODY)
    std = headers("msg_2", now, sig)
    assert standardwebhooks.webhooks.Webhook(SECRET).verify(BODY, std) == json.loads(BODY)
    svix.webhooks.Webhook(SECRET).verify(BODY, headers("msg_2", now, sig, "svix"))
    P.verify(inbound(BODY, std, now=now), source("standard", SECRET))


@pytest.mark.parametrize("signer", [SECRET, OLD_SECRET])
def test_rotation(signer: str) -> None:
    sig = our_sign(signer, "msg_3", T, BODY)
    P.verify(inbound(BODY, headers("msg_3", T, sig), now=T), source("standard", OLD_SECRET, SECRET))


def test_unusable_secret_is_skipped() -> None:
    sig = our_sign(SECRET, "msg_3", T, BODY)
    P.verify(inbound(BODY, headers("msg_3", T, sig), now=T), source("standard", "whsec_%%", SECRET))


def test_tampered_body_rejected() -> None:
    sig = our_sign(SECRET, "msg_4", T, BODY)
    with pytest.raises(SignatureError) as exc:
        P.verify(inbound(BODY + " ", headers("msg_4", T, sig), now=T), source("standard", SECRET))
    assert type(exc.value) is SignatureError


def test_changed_id_rejected() -> None:
    sig = our_sign(SECRET, "msg_4", T, BODY)
    with pytest.raises(SignatureError):
        P.verify(inbound(BODY, headers("msg_5", T, sig), now=T), source("standard", SECRET))


@pytest.mark.parametrize(
    ("now", "ok"), [(T + 60, True), (T - 60, True), (T + 61, False), (T - 61, False)]
)
def test_tolerance_is_ours_not_the_library_five_minutes(now: int, ok: bool) -> None:
    src = source("standard", SECRET, tolerance_seconds=60)
    d = inbound(BODY, headers("msg_6", T, our_sign(SECRET, "msg_6", T, BODY)), now=now)
    if ok:
        P.verify(d, src)
    else:
        with pytest.raises(TimestampError):
            P.verify(d, src)


def test_long_tolerance_beyond_five_minutes() -> None:
    d = inbound(BODY, headers("msg_7", T, our_sign(SECRET, "msg_7", T, BODY)), now=T + 3600)
    P.verify(d, source("standard", SECRET, tolerance_seconds=3600))
    with pytest.raises(TimestampError):
        P.verify(d, source("standard", SECRET))


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_missing_header(missing: str) -> None:
    h = headers("msg_8", T, our_sign(SECRET, "msg_8", T, BODY))
    del h[missing]
    with pytest.raises(SignatureError):
        P.verify(inbound(BODY, h, now=T), source("standard", SECRET))


def test_families_are_not_mixed() -> None:
    sig = our_sign(SECRET, "msg_9", T, BODY)
    mixed = {"svix-id": "msg_9", "svix-timestamp": str(T), "webhook-signature": sig}
    with pytest.raises(SignatureError, match="missing webhook-id header"):
        P.verify(inbound(BODY, mixed, now=T), source("standard", SECRET))


@pytest.mark.parametrize(
    ("ts", "sig"),
    [
        ("hello", None),
        ("1.5e9", None),
        (str(T), "v1"),
        (str(T), "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="),
        (str(T), "v1a,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="),
        (str(T), "v1,not base64!"),
    ],
)
def test_malformed_headers(ts: str, sig: str | None) -> None:
    h = {
        "webhook-id": "msg_10",
        "webhook-timestamp": ts,
        "webhook-signature": sig or our_sign(SECRET, "msg_10", T, BODY),
    }
    with pytest.raises(SignatureError) as exc:
        P.verify(inbound(BODY, h, now=T), source("standard", SECRET))
    assert type(exc.value) is SignatureError


def test_identify_type_and_missing_id() -> None:
    sig = our_sign(SECRET, "msg_11", T, BODY)
    ident = P.identify(inbound(BODY, headers("msg_11", T, sig), now=T), source("standard", SECRET))
    assert (ident.dedup_key, ident.event_type) == ("msg_11", "invoice.paid")
    with pytest.raises(MissingKeyError):
        P.identify(inbound(BODY, {"webhook-signature": sig}), source("standard", SECRET))


@pytest.mark.parametrize("stamp", ["1000000000000", "99999999999999999999"])
def test_timestamps_no_clock_can_hold_are_refused_not_a_crash(stamp):
    """A forged far-future timestamp is a 401, never a 500."""
    body = VEC_PAYLOAD
    headers = {"webhook-id": VEC_ID, "webhook-timestamp": stamp, "webhook-signature": VEC_SIGNATURE}
    with pytest.raises(SignatureError):
        P.verify(inbound(body, headers, now=VEC_TS), source("standard", VEC_SECRET))
