from __future__ import annotations

import json
import time

import pytest
from slack_sdk.signature import SignatureVerifier

from webhook_receiver.webhooks.providers import (
    MissingKeyError,
    PayloadError,
    SignatureError,
    SlackProvider,
    TimestampError,
)

from ...helpers.signing import inbound, slack_signature, source

P = SlackProvider()

# slackapi/python-slack-sdk tests/slack_sdk/signature/test_signature_verifier.py (itself
# from Slack's "Verifying requests from Slack" docs). The body is a form-encoded slash
# command, so only verify() is exercised with it.
VEC_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
VEC_BODY = (
    "token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V"
    "&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text="
    "&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmi"
    "bIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c"
)
VEC_TS = "1531420618"
VEC_SIGNATURE = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"

SECRET = "slack-signing-secret"
T = 1_700_000_000
EVENT = json.dumps(
    {
        "type": "event_callback",
        "event_id": "Ev08MFMKH6",
        "event": {"type": "app_mention", "text": "hi"},
    }
)


def delivery(body: str = EVENT, ts: int = T, now: float = T, secret: str = SECRET, **extra: str):
    h = {
        "X-Slack-Request-Timestamp": str(ts),
        "X-Slack-Signature": slack_signature(body, secret, ts),
    }
    h.update(extra)
    return inbound(body, h, now=now)


def test_published_vector() -> None:
    d = inbound(
        VEC_BODY,
        {"X-Slack-Request-Timestamp": VEC_TS, "X-Slack-Signature": VEC_SIGNATURE},
        now=int(VEC_TS),
        content_type="application/x-www-form-urlencoded",
    )
    P.verify(d, source("slack", VEC_SECRET))
    assert slack_signature(VEC_BODY, VEC_SECRET, VEC_TS) == VEC_SIGNATURE


def test_published_vector_tampered() -> None:
    d = inbound(
        VEC_BODY + "------",
        {"X-Slack-Request-Timestamp": VEC_TS, "X-Slack-Signature": VEC_SIGNATURE},
        now=int(VEC_TS),
    )
    with pytest.raises(SignatureError, match="signature does not match"):
        P.verify(d, source("slack", VEC_SECRET))


def test_accepts_sdk_signature() -> None:
    sig = SignatureVerifier(SECRET).generate_signature(timestamp=str(T), body=EVENT)
    assert sig == slack_signature(EVENT, SECRET, T)
    d = inbound(EVENT, {"X-Slack-Request-Timestamp": str(T), "X-Slack-Signature": sig}, now=T)
    P.verify(d, source("slack", SECRET))


def test_sdk_accepts_what_we_sign() -> None:
    now = int(time.time())
    d = delivery(ts=now, now=now)
    assert SignatureVerifier(SECRET).is_valid_request(EVENT, dict(d.headers)) is True
    P.verify(d, source("slack", SECRET))


@pytest.mark.parametrize("signer", ["old", "new"])
def test_rotation(signer: str) -> None:
    P.verify(delivery(secret=signer), source("slack", "old", "new"))


@pytest.mark.parametrize("now", [T + 300, T - 300])
def test_boundary_accepted(now: int) -> None:
    P.verify(delivery(now=now), source("slack", SECRET))


@pytest.mark.parametrize("now", [T + 301, T - 301])
def test_stale_and_future_rejected(now: int) -> None:
    with pytest.raises(TimestampError):
        P.verify(delivery(now=now), source("slack", SECRET))


def test_timestamp_is_signed() -> None:
    d = delivery()
    h = dict(d.headers) | {"X-Slack-Request-Timestamp": str(T + 1)}
    with pytest.raises(SignatureError, match="signature does not match"):
        P.verify(inbound(EVENT, h, now=T), source("slack", SECRET))


@pytest.mark.parametrize("drop", ["X-Slack-Request-Timestamp", "X-Slack-Signature"])
def test_missing_header(drop: str) -> None:
    h = {k: v for k, v in delivery().headers.items() if k != drop}
    with pytest.raises(SignatureError, match=f"missing {drop} header"):
        P.verify(inbound(EVENT, h, now=T), source("slack", SECRET))


@pytest.mark.parametrize(
    ("ts", "sig"),
    [("soon", None), (str(T), "v1=" + "00" * 32), (str(T), "abc"), (str(T), "v0=zz")],
)
def test_malformed_header(ts: str, sig: str | None) -> None:
    h = {
        "X-Slack-Request-Timestamp": ts,
        "X-Slack-Signature": sig or slack_signature(EVENT, SECRET, T),
    }
    with pytest.raises(SignatureError, match="malformed"):
        P.verify(inbound(EVENT, h, now=T), source("slack", SECRET))


def test_identify_event_callback() -> None:
    ident = P.identify(delivery(), source("slack", SECRET))
    assert (ident.dedup_key, ident.event_type) == ("Ev08MFMKH6", "app_mention")
    assert ident.immediate_response is None


def test_identify_falls_back_to_top_level_type() -> None:
    body = json.dumps({"type": "app_rate_limited", "event_id": "Ev1"})
    ident = P.identify(delivery(body), source("slack", SECRET))
    assert (ident.dedup_key, ident.event_type) == ("Ev1", "app_rate_limited")


def test_url_verification() -> None:
    body = json.dumps(
        {
            "token": "Jhj5dZrVaK7ZwHHjRyZWjbDl",
            "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P",
            "type": "url_verification",
        }
    )
    d = delivery(body)
    P.verify(d, source("slack", SECRET))
    ident = P.identify(d, source("slack", SECRET))
    assert ident.dedup_key == ""
    assert ident.event_type == "url_verification"
    assert ident.immediate_response == {
        "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"
    }


def test_url_verification_unsigned_is_rejected() -> None:
    body = json.dumps({"challenge": "c", "type": "url_verification"})
    with pytest.raises(SignatureError):
        P.verify(inbound(body, {}, now=T), source("slack", SECRET))


def test_url_verification_without_challenge() -> None:
    with pytest.raises(PayloadError):
        P.identify(delivery(json.dumps({"type": "url_verification"})), source("slack", SECRET))


def test_identify_missing_event_id() -> None:
    with pytest.raises(MissingKeyError):
        P.identify(delivery(json.dumps({"type": "event_callback"})), source("slack", SECRET))


def test_retry_headers_are_secret_headers() -> None:
    assert {"x-slack-retry-num", "x-slack-retry-reason"} <= P.secret_headers


# Slack's "app_rate_limited" callback (api.slack.com/apis/events-api#rate-limiting): a
# notice with no event_id.
RATE_LIMITED = json.dumps(
    {
        "token": "Jhj5dZrVaK7ZwHHjRyZWjbDl",
        "type": "app_rate_limited",
        "team_id": "T123456",
        "minute_rate_limited": 1518467820,
        "api_app_id": "A123456",
    }
)


@pytest.mark.parametrize(
    ("body", "callback"),
    [
        (RATE_LIMITED, "app_rate_limited"),
        (json.dumps({"type": "app_uninstalled_notice", "team_id": "T1"}), "app_uninstalled_notice"),
    ],
)
def test_id_less_callbacks_are_ignored_and_logged(body: str, callback: str, caplog) -> None:
    d = delivery(body)
    P.verify(d, source("slack", SECRET))
    with caplog.at_level("INFO", logger="webhook_receiver.webhooks.providers.slack"):
        ident = P.identify(d, source("slack", SECRET))
    assert ident.immediate_response == {"status": "ignored", "type": callback}
    (record,) = [r for r in caplog.records if r.name.endswith("slack")]
    assert record.levelname == "INFO"
    assert (record.outcome, record.callback_type) == ("ignored", callback)


def test_event_callback_without_event_id_is_still_missing_a_key() -> None:
    body = json.dumps({"type": "event_callback", "event": {"type": "app_mention"}})
    with pytest.raises(MissingKeyError):
        P.identify(delivery(body), source("slack", SECRET))


def test_id_less_callback_with_an_absurd_type_is_refused() -> None:
    with pytest.raises(PayloadError, match="callback type longer than"):
        P.identify(delivery(json.dumps({"type": "x" * 101})), source("slack", SECRET))
