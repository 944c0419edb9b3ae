from __future__ import annotations

import pytest

from webhook_receiver.webhooks.providers import (
    PROVIDERS,
    GenericProvider,
    StripeProvider,
    get_provider,
    needs_json,
    redacted_headers,
)

from ...helpers.signing import source


def test_each_provider_is_registered_under_its_name() -> None:
    assert all(p.name == name for name, p in PROVIDERS.items())


def test_get_provider() -> None:
    assert isinstance(get_provider("stripe"), StripeProvider)
    assert get_provider("generic") is PROVIDERS["generic"]
    assert isinstance(PROVIDERS["generic"], GenericProvider)
    with pytest.raises(KeyError, match="unknown provider 'nope'"):
        get_provider("nope")


def test_secret_headers_are_lower_case() -> None:
    for provider in PROVIDERS.values():
        assert all(h == h.lower() for h in provider.secret_headers)


def test_requires_json_flags() -> None:
    assert {n for n, p in PROVIDERS.items() if not p.requires_json} == {"cloudevents", "generic"}


def test_needs_json_is_per_source_for_generic() -> None:
    assert needs_json(source("generic", "s", signature_header="X-Sig")) is False
    assert needs_json(source("generic", "s", signature_header="X-Sig", dedup_key="json:/id"))
    assert needs_json(source("cloudevents", "s", signature_header="X-Sig")) is False
    assert needs_json(source("stripe", "s")) is True


def test_redacted_headers_add_the_configured_signature_header() -> None:
    assert redacted_headers(source("generic", "s", signature_header="X-Signature")) == {
        "x-signature"
    }
    assert redacted_headers(source("cloudevents", "s", signature_header="Ce-Sig")) == {"ce-sig"}
    assert redacted_headers(source("gitlab", "s")) == {"x-gitlab-token"}
    assert redacted_headers(source("standard", "s")) == {
        "webhook-signature",
        "svix-signature",
        "webhook-timestamp",
        "svix-timestamp",
    }


def test_redacted_headers_add_the_configured_timestamp_header() -> None:
    configured = source(
        "generic",
        "s",
        signature_header="X-Signature",
        extra={"signed_content": "{timestamp}.{body}", "timestamp_header": "X-Timestamp"},
    )
    assert redacted_headers(configured) == {"x-signature", "x-timestamp"}


def test_paddle_signature_is_redacted() -> None:
    assert redacted_headers(source("paddle", "s")) == {"paddle-signature"}
