from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from webhook_receiver.webhooks.providers import (
    GitHubProvider,
    MissingKeyError,
    PayloadError,
    SignatureError,
)

from ...helpers.signing import hmac_hex, inbound, source

P = GitHubProvider()

# GitHub docs, "Validating webhook deliveries" (docs.github.com/en/webhooks/using-webhooks/
# validating-webhook-deliveries), section "Testing the webhook payload validation".
DOC_SECRET = "It's a Secret to Everybody"
DOC_PAYLOAD = "Hello, World!"
DOC_SIGNATURE = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"

SECRET = "gh-secret"
BODY = json.dumps({"action": "opened", "issue": {"number": 1}})
DELIVERY = "72d3162e-cc78-11e3-81ab-4c9367dc0958"


def delivery(body: str = BODY, secret: str | None = SECRET, **headers: str):
    base = {"X-GitHub-Event": "issues", "X-GitHub-Delivery": DELIVERY}
    if secret is not None:
        base["X-Hub-Signature-256"] = "sha256=" + hmac_hex(body.encode(), secret)
    base.update(headers)
    return inbound(body, base)


def test_documented_vector() -> None:
    P.verify(
        inbound(DOC_PAYLOAD, {"X-Hub-Signature-256": DOC_SIGNATURE}, content_type="text/plain"),
        source("github", DOC_SECRET),
    )


def test_documented_vector_wrong_secret() -> None:
    with pytest.raises(SignatureError):
        P.verify(
            inbound(DOC_PAYLOAD, {"X-Hub-Signature-256": DOC_SIGNATURE}),
            source("github", "It's a secret to everybody"),
        )


def test_uppercase_hex_accepted() -> None:
    P.verify(
        inbound(DOC_PAYLOAD, {"X-Hub-Signature-256": DOC_SIGNATURE.upper().replace("SHA", "sha")}),
        source("github", DOC_SECRET),
    )


@pytest.mark.parametrize("signer", ["old", "new"])
def test_rotation(signer: str) -> None:
    P.verify(delivery(secret=signer), source("github", "old", "new"))


def test_tampered_body_rejected() -> None:
    d = delivery()
    with pytest.raises(SignatureError, match="signature does not match"):
        P.verify(inbound(BODY + " ", dict(d.headers)), source("github", SECRET))


def test_missing_header() -> None:
    with pytest.raises(SignatureError, match="missing X-Hub-Signature-256 header"):
        P.verify(delivery(secret=None), source("github", SECRET))


@pytest.mark.parametrize(
    "value",
    [
        hmac_hex(BODY.encode(), SECRET),  # no scheme
        "sha1=" + hmac_hex(BODY.encode(), SECRET),
        "sha256=",
        "sha256=xyz",
    ],
)
def test_malformed_header(value: str) -> None:
    with pytest.raises(SignatureError, match="malformed X-Hub-Signature-256 header"):
        P.verify(delivery(secret=None, **{"X-Hub-Signature-256": value}), source("github", SECRET))


def test_identify_event_and_action() -> None:
    ident = P.identify(delivery(), source("github", SECRET))
    assert (ident.dedup_key, ident.event_type) == (DELIVERY, "issues.opened")


def test_identify_without_action() -> None:
    body = json.dumps({"zen": "Keep it logically awesome.", "hook_id": 1})
    ident = P.identify(delivery(body, **{"X-GitHub-Event": "ping"}), source("github", SECRET))
    assert (ident.dedup_key, ident.event_type) == (DELIVERY, "ping")


def test_identify_missing_delivery() -> None:
    d = delivery()
    headers = {k: v for k, v in d.headers.items() if k.lower() != "x-github-delivery"}
    with pytest.raises(MissingKeyError):
        P.identify(inbound(BODY, headers), source("github", SECRET))


def test_a_delivery_id_sent_twice_is_refused() -> None:
    # Joined with a comma by the server, it would be a new key each time.
    with pytest.raises(PayloadError, match="X-GitHub-Delivery header was sent more than once"):
        P.identify(delivery(**{"X-GitHub-Delivery": f"{DELIVERY},{DELIVERY}"}), source("github"))


FORM = "application/x-www-form-urlencoded"


def form_delivery(body: str, secret: str = SECRET):
    h = {
        "X-GitHub-Event": "issues",
        "X-GitHub-Delivery": DELIVERY,
        "X-Hub-Signature-256": "sha256=" + hmac_hex(body.encode(), secret),
    }
    return inbound(body, h, content_type=FORM)


def test_form_delivery_is_verified_over_the_raw_form_then_decoded() -> None:
    from urllib.parse import urlencode

    form = urlencode({"payload": BODY})
    d = form_delivery(form)
    assert d.json is None  # a form body is not JSON
    P.verify(d, source("github", SECRET))
    decoded = P.decode(d, source("github", SECRET))
    assert decoded.json == json.loads(BODY)
    assert decoded.body == form.encode()  # the raw bytes stay as sent
    ident = P.identify(decoded, source("github", SECRET))
    assert (ident.dedup_key, ident.event_type) == (DELIVERY, "issues.opened")


def test_form_signature_covers_the_form_not_the_json() -> None:
    from urllib.parse import urlencode

    d = form_delivery(urlencode({"payload": BODY}))
    signed_json = {
        **dict(d.headers),
        "X-Hub-Signature-256": "sha256=" + hmac_hex(BODY.encode(), SECRET),
    }
    with pytest.raises(SignatureError):
        P.verify(inbound(d.body, signed_json, content_type=FORM), source("github", SECRET))


def test_json_delivery_is_not_decoded() -> None:
    d = delivery()
    assert P.decode(d, source("github", SECRET)) is d


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ("", "exactly one payload field"),
        ("other=1", "exactly one payload field"),
        ("payload=%7B%7D&payload=%7B%7D", "exactly one payload field"),
        ("payload=not-json", "the payload field is not JSON"),
        ("payload=%FF", "cannot be read"),
        ("payload=%7B%7D&&", "cannot be read"),
        ("payload=é", "cannot be read"),
        ("&".join(f"f{i}=1" for i in range(20)), "cannot be read"),
    ],
)
def test_unreadable_forms_are_payload_errors(form: str, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        P.decode(form_delivery(form), source("github", SECRET))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(payload=st.dictionaries(st.text(max_size=8), _JSON, max_size=6), indent=st.booleans())
def test_a_form_delivery_reads_as_the_json_delivery_of_the_same_content(payload, indent) -> None:
    from urllib.parse import urlencode

    from webhook_receiver.fingerprint import canonical_json

    text = json.dumps(payload, indent=2 if indent else None, ensure_ascii=indent)
    decoded = P.decode(form_delivery(urlencode({"payload": text})), source("github", SECRET))
    assert canonical_json(decoded.json) == canonical_json(json.loads(text))
