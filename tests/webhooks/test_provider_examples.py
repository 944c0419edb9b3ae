"""The worked examples of docs/providers.md, received through the app on both databases.

The TOML blocks are read from the document itself, so what it shows is what
runs; each delivery is signed as the provider signs (Paddle's is checked by
Paddle's SDK in tests/webhooks/providers/test_paddle.py, Linear's was accepted by
@linear/sdk when tests/fixtures/linear_delivery.json was generated).
"""

from __future__ import annotations

import json
import re
import time
import tomllib
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from webhook_receiver.config import parse
from webhook_receiver.extensions import db
from webhook_receiver.models import Event, Rejection
from webhook_receiver.webhooks.providers import PROVIDERS

from ..helpers import count
from ..helpers.signing import hmac_b64, hmac_hex

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "providers.md"
LINEAR = json.loads((ROOT / "tests" / "fixtures" / "linear_delivery.json").read_text())

SECRETS = {
    "partner": "partner-secret-0123456789",
    "paddle": "pdl_ntfset_01gkpjp8bkm3tm53kdgkx6sms7_6h3qd3uFSi9YCD3OLYAShQI90XTI6vEY",
    "linear": "lin_wh_test_secret_0123456789",  # as in tests/fixtures/generate.mjs
    "intercom": "intercom-client-secret-0123",
    "twitch": "twitch-eventsub-secret-0123",
    "zoom": "zoom-secret-token-0123456789",
}


def documented_sources() -> dict[str, dict[str, Any]]:
    """Every [sources.*] table of the document's TOML blocks, with the test secrets."""
    sources: dict[str, dict[str, Any]] = {}
    for block in re.findall(r"```toml\n(.*?)```", DOC.read_text(), re.S):
        sources.update(tomllib.loads(block)["sources"])
    for name, table in sources.items():
        table["secrets"] = [SECRETS[name]]
    return sources


def hexmac(name: str, message: str | bytes, algorithm: str = "sha256") -> str:
    """The HMAC of ``message`` as hex, keyed with the documented source ``name``'s secret."""
    return hmac_hex(message, SECRETS[name], algorithm)


def rfc3339(t: int) -> str:
    # As Twitch sends it: UTC, nanoseconds.
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S") + ".634234626Z"


Delivery = tuple[bytes, dict[str, str]]


def partner(key: str, t: int) -> Delivery:
    body = json.dumps({"id": key, "type": "partner.thing"})
    return body.encode(), {
        "Content-Type": "application/json",
        "X-Timestamp": str(t),
        "X-Signature": "sha256=" + hexmac("partner", f"{t}.{body}"),
    }


def paddle(key: str, t: int) -> Delivery:
    body = json.dumps(
        {
            "event_id": key,
            "event_type": "transaction.completed",
            "occurred_at": "2023-08-21T11:57:47.390028Z",
            "notification_id": "ntf_" + key.removeprefix("evt_"),
            "data": {"id": "txn_01h8bzakzx3hm2fmen703n5q45"},
        }
    )
    return body.encode(), {
        "Content-Type": "application/json",
        "Paddle-Signature": f"ts={t};h1={hexmac('paddle', f'{t}:{body}')}",
    }


def linear(key: str, t: int) -> Delivery:
    # Signed once by the generator and accepted by @linear/sdk; no timestamp header.
    return LINEAR["body"].encode(), dict(LINEAR["headers"])


def intercom(key: str, t: int) -> Delivery:
    body = json.dumps(
        {
            "type": "notification_event",
            "id": key,
            "topic": "conversation.user.created",
            "app_id": "abc123",
            "data": {"item": {"type": "conversation", "id": "1"}},
            "created_at": 1700000000,
        }
    )
    return body.encode(), {
        "Content-Type": "application/json",
        "X-Hub-Signature": "sha1=" + hexmac("intercom", body, "sha1"),
    }


def twitch(key: str, t: int) -> Delivery:
    body = json.dumps(
        {
            "subscription": {
                "id": "f1c2a387-161a-49f9-a165-0f21d7a4e1c4",
                "type": "channel.follow",
            },
            "event": {"user_id": "1234", "broadcaster_user_id": "1337"},
        }
    )
    stamp = rfc3339(t)
    return body.encode(), {
        "Content-Type": "application/json",
        "Twitch-Eventsub-Message-Id": key,
        "Twitch-Eventsub-Message-Retry": "0",
        "Twitch-Eventsub-Message-Type": "notification",
        "Twitch-Eventsub-Message-Timestamp": stamp,
        "Twitch-Eventsub-Subscription-Type": "channel.follow",
        "Twitch-Eventsub-Subscription-Version": "1",
        "Twitch-Eventsub-Message-Signature": "sha256=" + hexmac("twitch", key + stamp + body),
    }


def zoom(key: str, t: int) -> Delivery:
    body = json.dumps(
        {
            "event": "meeting.started",
            "event_ts": int(key),
            "payload": {"account_id": "AAAAAA", "object": {"id": "1234567890"}},
        }
    )
    return body.encode(), {
        "Content-Type": "application/json",
        "x-zm-request-timestamp": str(t),
        "x-zm-signature": "v0=" + hexmac("zoom", f"v0:{t}:{body}"),
    }


EXAMPLES: dict[str, tuple[Callable[[str, int], Delivery], str, str, str | None]] = {
    # name: (signer, dedup key, stored type, the header carrying a signed timestamp)
    "partner": (partner, "evt_1", "partner.thing", "X-Timestamp"),
    "paddle": (paddle, "evt_01h8bzakzx3hm2fmen703n5q45", "transaction.completed", "Paddle"),
    "linear": (linear, LINEAR["headers"]["Linear-Delivery"], "Issue", None),
    "intercom": (
        intercom,
        "notif_ccd8a4d0-f965-11e3-a367-c779cae3e1b3",
        "conversation.user.created",
        None,
    ),
    "twitch": (
        twitch,
        str(uuid.UUID(int=7)),
        "channel.follow",
        "Twitch-Eventsub-Message-Timestamp",
    ),
    "zoom": (zoom, "1626230691572", "meeting.started", "x-zm-request-timestamp"),
}


@pytest.fixture
def app(make_app):
    return make_app({"sources": documented_sources()})


def test_every_documented_block_is_a_valid_config() -> None:
    sources = documented_sources()
    assert set(EXAMPLES) <= set(sources)
    parsed = parse({"sources": sources}, str(DOC), providers=PROVIDERS)
    assert parsed.sources["twitch"].extra["signed_content"] == "{id}{timestamp}{body}"


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_documented_example_is_received_once(app, name) -> None:
    sign, key, event_type, _ = EXAMPLES[name]
    client = app.test_client()
    now = int(time.time())
    first = client.post(
        f"/webhooks/{name}", data=sign(key, now - 30)[0], headers=sign(key, now - 30)[1]
    )
    assert first.status_code == 200, first.get_json()
    assert first.get_json()["status"] == "accepted"
    # The provider retries later, signing again.
    body, headers = sign(key, now)
    again = client.post(f"/webhooks/{name}", data=body, headers=headers)
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_json() == first.get_json()
    with app.app_context():
        (event,) = db.session.scalars(select(Event)).all()
        assert (event.dedup_key, event.event_type) == (key, event_type)
        stored = {k.lower(): v for k, v in event.headers}
        table = documented_sources()[name]
        signature_header = table.get("signature_header", "Paddle-Signature").lower()
        assert stored[signature_header] == "[redacted]"
        if "timestamp_header" in table:  # it changes on every attempt
            assert stored[table["timestamp_header"].lower()] == "[redacted]"


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_documented_example_tampered_is_401(app, name) -> None:
    sign, key, _, _ = EXAMPLES[name]
    body, headers = sign(key, int(time.time()))
    tampered = body.replace(b'"', b"'", 1) if name != "linear" else body + b" "
    response = app.test_client().post(f"/webhooks/{name}", data=tampered, headers=headers)
    assert response.status_code == 401
    assert response.get_json()["type"] == "/problems/signature-invalid"
    assert count(app, Event) == 0
    assert count(app, Rejection) == 1


@pytest.mark.parametrize("name", [n for n, e in EXAMPLES.items() if e[3]])
@pytest.mark.parametrize("offset", [-1000, 1000])
def test_documented_example_stale_or_future_is_401(app, name, offset) -> None:
    sign, key, _, _ = EXAMPLES[name]
    body, headers = sign(key, int(time.time()) + offset)
    response = app.test_client().post(f"/webhooks/{name}", data=body, headers=headers)
    assert response.status_code == 401
    assert response.get_json()["type"] == "/problems/timestamp-out-of-tolerance"
    assert count(app, Event) == 0


@pytest.mark.parametrize(
    ("name", "header", "value"),
    [
        ("partner", "X-Timestamp", "9" * 5000),
        ("paddle", "Paddle-Signature", "ts=" + "9" * 5000 + ";h1=" + "0" * 64),
        ("twitch", "Twitch-Eventsub-Message-Timestamp", "9999-99-99T99:99:99Z"),
        ("zoom", "x-zm-request-timestamp", "-1"),
    ],
)
def test_absurd_timestamps_are_401_and_change_nothing(app, name, header, value) -> None:
    sign, key, _, _ = EXAMPLES[name]
    body, headers = sign(key, int(time.time()))
    response = app.test_client().post(
        f"/webhooks/{name}", data=body, headers={**headers, header: value}
    )
    assert response.status_code == 401
    assert response.mimetype == "application/problem+json"
    assert count(app, Event) == 0


@pytest.mark.parametrize(
    ("change", "signature"),
    [
        ("sha1 instead of sha256", lambda m: hexmac("partner", m, "sha1")),
        ("sha512 instead of sha256", lambda m: hexmac("partner", m, "sha512")),
        ("base64 instead of hex", lambda m: hmac_b64(m, SECRETS["partner"])),
    ],
)
def test_partner_signed_by_another_algorithm_or_encoding_is_401(app, change, signature) -> None:
    t = int(time.time())
    body, headers = partner("evt_1", t)
    headers["X-Signature"] = "sha256=" + signature(f"{t}.".encode() + body)
    response = app.test_client().post("/webhooks/partner", data=body, headers=headers)
    assert response.status_code == 401
    assert response.get_json()["type"] == "/problems/signature-invalid"
    assert count(app, Event) == 0
    assert count(app, Rejection) == 1
