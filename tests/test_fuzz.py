"""Generated requests over every HTTP surface: never a 5xx, problem+json refusals, nothing stored.

Bounded: each surface runs a fixed number of examples (no deadline per
example, so a loaded machine does not fail a run). What is generated mixes
the plausible (valid JSON, correctly signed deliveries, real ids) with the
hostile (odd bytes, huge numbers, repeated members, overlong values), so
that both the checks and the paths behind them run.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from flask import Flask
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from webhook_receiver.models import Delivery, Event, EventConflict

from .admin.conftest import PASSWORD, csrf_token, login
from .conftest import CLIENTS, bearer
from .helpers import counts
from .helpers import signing as s
from .helpers.signing import delivery_for

FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure is reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
STORED = (Event, EventConflict, Delivery)

# Header values a client can send (no CR/LF: the server's parser refuses those).
header_text = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f\x85"),
    max_size=80,
)
numbers = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["1e400", "-5e400", "1" + "0" * 500, "0.1e-999", "9" * 30]),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=20)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _json_text(value: Any) -> str:
    # Number spellings given as strings go in raw, so overflowing ones are sent as such.
    if isinstance(value, str) and value and value[0] in "-0123456789" and value[-1].isdigit():
        return value
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_json_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_json_text(v) for v in value) + "]"
    return json.dumps(value)


bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: _json_text(v).encode()),
    st.builds(
        lambda t, d: _json_text({"type": t, "data": d}).encode(), st.text(max_size=30), json_values
    ),
    st.sampled_from(
        [
            b'{"type":"x","type":"y","data":1}',
            b'{"id":"a","id":"b"}',
            b'{"type":"x","data":1e400}',
            b'{"id":1e400}',
            b"[" * 300 + b"]" * 300,
            b'"\\ud800"',
            b"\xff\xfe",
        ]
    ),
)
content_types = st.one_of(
    st.sampled_from(["application/json", "application/cloudevents+json", "text/plain", ""]),
    header_text,
)


@pytest.fixture
def app(make_app: Callable[..., Flask]) -> Flask:
    return make_app({"clients": CLIENTS, "sources": s.SOURCES}, ADMIN_PASSWORD=PASSWORD)


def _not_json(name: str) -> Any:
    raise AssertionError(f"{name} in an answer is not JSON")


def strict_json(data: bytes) -> Any:
    """Parse an answer as RFC 8259 JSON: no NaN or Infinity."""
    return json.loads(data, parse_constant=_not_json)


def check(app: Flask, response: Any, before: dict[str, int], *, machine: bool) -> None:
    """No 5xx; a machine surface's 4xx is problem+json; a refusal stored nothing."""
    status = response.status_code
    assert status < 500, response.get_data(as_text=True)[:500]
    if machine and response.data and response.is_json:
        strict_json(response.data)  # every answer, replays included, is JSON a client can read
    if status < 400:
        return
    if machine:
        assert response.mimetype == "application/problem+json", (status, response.data[:200])
        if response.data:  # a HEAD answer has no body
            assert response.get_json()["status"] == status
    after = counts(app, *STORED)
    if (
        status == 422
        and (response.get_json(silent=True) or {}).get("type") == "/problems/dedup-key-conflict"
    ):
        # By design: the conflicting delivery is kept for review, nothing else.
        assert {k: v for k, v in after.items() if k != "event_conflicts"} == {
            k: v for k, v in before.items() if k != "event_conflicts"
        }
        return
    assert after == before, (status, response.data[:200])


@FUZZ
@given(
    body=st.one_of(
        bodies,
        # Mostly well-formed events, so that requests get past the checks up front.
        st.builds(lambda d: _json_text({"type": "t", "data": d}).encode(), json_values),
    ),
    content_type=st.one_of(st.just("application/json"), content_types),
    key=st.one_of(
        st.uuids().map(str),
        st.none(),
        header_text,
        st.text(string.printable.strip() + " ", max_size=300),
    ),
    authorized=st.sampled_from([True, True, True, False]),
)
def test_fuzz_post_api_events(app, body, content_type, key, authorized) -> None:
    client = app.test_client()
    headers = {"Content-Type": content_type, **(bearer() if authorized else {})}
    if key is not None:
        headers["Idempotency-Key"] = key
    before = counts(app, *STORED)
    check(app, client.post("/api/events", data=body, headers=headers), before, machine=True)


@FUZZ
@given(
    segment=st.one_of(
        st.integers(min_value=-(2**70), max_value=2**70).map(str),
        st.text(max_size=30),
    )
)
def test_fuzz_get_api_event(app, segment) -> None:
    client = app.test_client()
    response = client.get("/api/events/" + quote(segment, safe=""), headers=bearer())
    check(app, response, counts(app, *STORED), machine=True)


@FUZZ
@given(
    source=st.sampled_from([*s.SOURCES, "nowhere"]),
    body=bodies,
    content_type=content_types,
    extra=st.dictionaries(
        st.sampled_from(
            [
                "Stripe-Signature",
                "X-Hub-Signature-256",
                "X-GitHub-Delivery",
                "webhook-id",
                "webhook-timestamp",
                "webhook-signature",
                "X-Shopify-Hmac-Sha256",
                "X-Shopify-Webhook-Id",
                "X-Slack-Signature",
                "X-Slack-Request-Timestamp",
                "X-Gitlab-Token",
                "Idempotency-Key",
                "X-Signature",
                "X-Hub-Signature",
                "ce-id",
                "ce-source",
            ]
        ),
        header_text,
        max_size=4,
    ),
    signed=st.booleans(),
    key=header_text.filter(str.strip),
)
def test_fuzz_post_webhooks(app, source, body, content_type, extra, signed, key) -> None:
    client = app.test_client()
    headers = {"Content-Type": content_type, **extra}
    if signed and source != "nowhere":
        # A valid delivery, with generated headers laid over it.
        body, valid = delivery_for(source, key or "k")
        headers = {**valid, **extra}
    before = counts(app, *STORED)
    response = client.post(f"/webhooks/{quote(source)}", data=body, headers=headers)
    check(app, response, before, machine=True)


ADMIN_PAGES = ["/admin/", "/admin/events", "/admin/dead", "/admin/conflicts", "/admin/idempotency"]
ADMIN_PAGES += ["/admin/rejections"]
admin_params = st.dictionaries(
    st.sampled_from(
        ["before", "after", "q", "since", "until", "state", "source", "type", "view", "consumer"]
    ),
    st.one_of(
        st.text(max_size=30),
        st.integers(min_value=-(2**70), max_value=2**70).map(str),
        st.builds(lambda a, b: f"{a}.{b}", st.integers(-(2**70), 2**70), st.integers(0, 2**70)),
        st.sampled_from(["0001-01-01T00:00+01:00", "9999-12-31T23:59-01:00", "²", "1.²"]),
    ),
    max_size=3,
)


@FUZZ
@given(page=st.sampled_from(ADMIN_PAGES), params=admin_params)
def test_fuzz_admin_lists(app, page, params) -> None:
    client = app.test_client()
    assert login(client).status_code == 302
    response = client.get(page + "?" + urlencode(params))
    check(app, response, counts(app, *STORED), machine=False)


@FUZZ
@given(
    target=st.sampled_from(
        [
            "/admin/events/{}",
            "/admin/conflicts/{}",
            "/admin/idempotency/{}/evict",
            "/admin/conflicts/{}/review",
            "/admin/deliveries/requeue",
            "/admin/deliveries/discard",
        ]
    ),
    ident=st.one_of(st.integers(min_value=0, max_value=2**70), st.just(1)),
    form=st.dictionaries(
        st.sampled_from(["ids", "page_ids", "note", "confirm", "next"]),
        st.text(max_size=40),
        max_size=3,
    ),
)
def test_fuzz_admin_pages_and_actions(app, target, ident, form) -> None:
    client = app.test_client()
    assert login(client).status_code == 302
    url = target.format(ident)
    before = counts(app, *STORED)
    if target.endswith("{}"):
        response = client.get(url)
    else:
        token = csrf_token(client, "/admin/")
        response = client.post(url, data={**form, "csrf_token": token})
    check(app, response, before, machine=False)


@FUZZ
@given(
    path=st.one_of(
        st.sampled_from(["/healthz", "/readyz", "/metrics"]),
        st.text(max_size=20).map(lambda t: "/problems/" + quote(t, safe="")),
    ),
    method=st.sampled_from(["GET", "HEAD", "POST", "DELETE"]),
)
def test_fuzz_probes(app, path, method) -> None:
    client = app.test_client()
    response = client.open(path, method=method)
    check(app, response, counts(app, *STORED), machine=True)
