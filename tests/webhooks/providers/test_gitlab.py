from __future__ import annotations

import json

import pytest

from webhook_receiver.webhooks.providers import GitLabProvider, MissingKeyError, SignatureError

from ...helpers.signing import inbound, source

P = GitLabProvider()
BODY = json.dumps({"object_kind": "push", "ref": "refs/heads/main"})
IDEM = "f6b1bb6e-6b0a-4d3b-a0b2-0a2f6a0e3b0c"
EVENT_UUID = "13792a34-cac6-4fda-95a8-c58e00a3954e"


def delivery(token: str | None = "tok-new", **extra: str):
    h = {"X-Gitlab-Event": "Push Hook", "X-Gitlab-Event-UUID": EVENT_UUID, "Idempotency-Key": IDEM}
    if token is not None:
        h["X-Gitlab-Token"] = token
    h.update(extra)
    return inbound(BODY, {k: v for k, v in h.items() if v})


@pytest.mark.parametrize("token", ["tok-old", "tok-new"])
def test_rotation(token: str) -> None:
    P.verify(delivery(token), source("gitlab", "tok-old", "tok-new"))


@pytest.mark.parametrize("token", ["tok-ne", "tok-newer", "TOK-NEW", "tok-old"])
def test_wrong_token(token: str) -> None:
    with pytest.raises(SignatureError, match="token does not match"):
        P.verify(delivery(token), source("gitlab", "tok-new"))


def test_missing_token() -> None:
    with pytest.raises(SignatureError, match="missing X-Gitlab-Token header"):
        P.verify(delivery(None), source("gitlab", "tok-new"))


def test_identify_prefers_idempotency_key() -> None:
    ident = P.identify(delivery(), source("gitlab", "tok-new"))
    assert (ident.dedup_key, ident.event_type) == (IDEM, "Push Hook")


def test_identify_falls_back_to_event_uuid() -> None:
    ident = P.identify(delivery(**{"Idempotency-Key": ""}), source("gitlab", "tok-new"))
    assert ident.dedup_key == EVENT_UUID


def test_identify_event_type_from_object_kind() -> None:
    ident = P.identify(delivery(**{"X-Gitlab-Event": ""}), source("gitlab", "tok-new"))
    assert ident.event_type == "push"


def test_identify_without_any_key() -> None:
    with pytest.raises(MissingKeyError):
        P.identify(
            delivery(**{"Idempotency-Key": "", "X-Gitlab-Event-UUID": ""}),
            source("gitlab", "tok-new"),
        )
