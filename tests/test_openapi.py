"""/openapi.json is true: real responses of every documented endpoint validate against it.

openapi-core checks each response (status, headers, content type, body)
of the Flask app on SQLite and PostgreSQL against the served document, and
each request against its operation. The problem-type pages are here too:
they are what a problem's ``type`` links to.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from flask.testing import FlaskClient
from openapi_core import Config, OpenAPI
from openapi_core.contrib.werkzeug import WerkzeugOpenAPIRequest, WerkzeugOpenAPIResponse
from werkzeug.test import EnvironBuilder

from webhook_receiver.problems import PROBLEM_JSON, PROBLEM_TYPES

from .conftest import ACME_TOKEN, CLIENTS, GLOBEX_TOKEN, bearer
from .helpers import post_event
from .helpers.signing import GENERIC_SECRET, SLACK_SECRET, hmac_hex, slack_delivery

SOURCES = {
    "partner": {
        "provider": "generic",
        "secrets": [GENERIC_SECRET],
        "signature_header": "X-Signature",
        "dedup_key": "json:/id",
    },
    "slack": {"provider": "slack", "secrets": [SLACK_SECRET]},
    "ce": {
        "provider": "cloudevents",
        "secrets": [GENERIC_SECRET],
        "signature_header": "X-Signature",
    },
}


class RecordingClient(FlaskClient):
    """A test client that keeps each request's body in its environ, for the validator."""

    def open(self, *args: Any, **kwargs: Any) -> Any:
        data = kwargs.get("data") or b""
        body = data.encode() if isinstance(data, str) else data
        kwargs["environ_base"] = {**kwargs.get("environ_base", {}), "test.body": body}
        return super().open(*args, **kwargs)


@pytest.fixture
def api(make_app):
    app = make_app({"clients": CLIENTS, "sources": SOURCES}, METRICS_TOKEN="metrics-token-0123")
    app.test_client_class = RecordingClient
    return app.test_client()


@pytest.fixture
def spec(api) -> OpenAPI:
    response = api.get("/openapi.json")
    assert response.status_code == 200
    # Building it validates the document against the OpenAPI 3.1 schema.
    # problem+json is JSON; openapi-core knows only application/json by name.
    config = Config(extra_media_type_deserializers={PROBLEM_JSON: json.loads})
    return OpenAPI.from_dict(response.get_json(), config=config)


def checked(spec: OpenAPI, response: Any, *, request_too: bool = True) -> Any:
    """Validate a test client response (and its request) against the document."""
    sent = response.request
    # The app has read the body of the request it got: rebuild it as sent.
    request = WerkzeugOpenAPIRequest(
        EnvironBuilder(
            method=sent.method,
            path=sent.path,
            query_string=sent.query_string,
            headers=list(sent.headers.items()),
            data=sent.environ["test.body"],
        ).get_request()
    )
    if request_too:
        spec.validate_request(request)
    spec.validate_response(request, WerkzeugOpenAPIResponse(response))
    return response


def _signed(payload: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    body = json.dumps(payload).encode()
    return body, {"Content-Type": "application/json", "X-Signature": "sha256=" + hmac_hex(body)}


def test_the_document_is_openapi_3_1_and_lists_every_problem_type(spec, api):
    doc = api.get("/openapi.json").get_json()
    assert doc["openapi"] == "3.1.0"
    problem = doc["components"]["schemas"]["Problem"]["properties"]["type"]
    assert set(problem["enum"]) == {f"/problems/{slug}" for slug in PROBLEM_TYPES}
    for slug in PROBLEM_TYPES:
        assert f"`/problems/{slug}`" in problem["description"]


def test_api_event_created_replayed_read_and_refused_match_the_document(spec, api):
    created = checked(spec, post_event(api, "order-42", {"type": "order.created", "data": 42}))
    assert created.status_code == 201
    replay = checked(spec, post_event(api, "order-42", {"type": "order.created", "data": 42}))
    assert replay.headers["Idempotent-Replayed"] == "true"
    reused = checked(spec, post_event(api, "order-42", {"type": "order.created", "data": 43}))
    assert reused.status_code == 422
    location = created.headers["Location"]
    assert checked(spec, api.get(location, headers=bearer())).status_code == 200
    # Another client's event is a 404, like a missing one.
    assert checked(spec, api.get(location, headers=bearer(GLOBEX_TOKEN))).status_code == 404


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [
        ({}, b'{"type": "t", "data": 1}', 401),
        ({"Authorization": f"Bearer {ACME_TOKEN}"}, b'{"type": "t", "data": 1}', 400),
        (
            {"Authorization": f"Bearer {ACME_TOKEN}", "Idempotency-Key": "bad-json"},
            b'{"type": ',
            400,
        ),
        (
            {"Authorization": f"Bearer {ACME_TOKEN}", "Idempotency-Key": "no-data"},
            b'{"type": "t"}',
            400,
        ),
    ],
)
def test_refused_api_requests_are_documented_problems(spec, api, headers, body, status):
    response = api.post(
        "/api/events", data=body, headers={**headers, "Content-Type": "application/json"}
    )
    assert response.status_code == status
    assert response.mimetype == "application/problem+json"
    # The request itself breaks the contract on purpose: only the answer is checked.
    checked(spec, response, request_too=False)


def test_webhook_accepted_redelivered_conflicting_and_refused_match_the_document(spec, api):
    body, headers = _signed({"id": "evt-1", "type": "demo"})
    accepted = checked(spec, api.post("/webhooks/partner", data=body, headers=headers))
    assert accepted.get_json()["status"] == "accepted"
    again = checked(spec, api.post("/webhooks/partner", data=body, headers=headers))
    assert again.headers["Idempotent-Replayed"] == "true"
    other, other_headers = _signed({"id": "evt-1", "type": "changed"})
    conflict = checked(spec, api.post("/webhooks/partner", data=other, headers=other_headers))
    assert conflict.status_code == 422
    forged = {**headers, "X-Signature": "sha256=" + "0" * 64}
    assert (
        checked(spec, api.post("/webhooks/partner", data=body, headers=forged)).status_code == 401
    )
    unknown = checked(spec, api.post("/webhooks/nobody", data=body, headers=headers))
    assert unknown.status_code == 404


def test_slack_url_verification_challenge_matches_the_document(spec, api):
    body, headers = slack_delivery({"type": "url_verification", "challenge": "c-123"})
    response = checked(spec, api.post("/webhooks/slack", data=body, headers=headers))
    assert response.get_json() == {"challenge": "c-123"}


def test_probes_and_metrics_match_the_document(spec, api):
    assert checked(spec, api.get("/healthz")).status_code == 200
    assert checked(spec, api.get("/readyz")).status_code == 200
    metrics = checked(
        spec, api.get("/metrics", headers={"Authorization": "Bearer metrics-token-0123"})
    )
    assert b"webhook_receiver_received_total" in metrics.data
    assert checked(spec, api.get("/metrics"), request_too=False).status_code == 401


def test_problem_type_descriptions_match_the_document(spec, api):
    listed = checked(spec, api.get("/problems"))
    assert len(listed.get_json()) == len(PROBLEM_TYPES)
    for slug in PROBLEM_TYPES:
        doc = checked(spec, api.get(f"/problems/{slug}")).get_json()
        assert doc["type"] == f"/problems/{slug}"
        assert len(doc["description"]) > 40  # a sentence a developer can act on
    assert checked(spec, api.get("/problems/no-such-problem")).status_code == 404


def test_a_browser_following_a_problem_type_gets_a_readable_page(api):
    response = api.get(
        "/problems/dedup-key-conflict", headers={"Accept": "text/html,application/xhtml+xml"}
    )
    assert response.status_code == 200
    assert response.mimetype == "text/html"
    page = response.get_data(as_text=True)
    assert "<h1>Dedup key reused with different content</h1>" in page
    assert "kept for an operator to review" in page


def test_a_problem_answer_links_to_its_description(api):
    refused = post_event(api, "", {"type": "t", "data": 1})
    described = api.get(refused.get_json()["type"])
    assert described.status_code == 200
    assert described.get_json()["status"] == refused.status_code


def test_slack_notice_ignored_matches_the_document(spec, api):
    # A callback without event_id is answered {"status": "ignored", "type": ...}:
    # the document's 200 allowed only "accepted" and the challenge.
    body, headers = slack_delivery({"type": "app_rate_limited", "minute_rate_limited": 1})
    response = checked(spec, api.post("/webhooks/slack", data=body, headers=headers))
    assert response.get_json() == {"status": "ignored", "type": "app_rate_limited"}


def test_cloudevents_batch_accepted_and_redelivered_matches_the_document(spec, api):
    # A batch is answered with each entry's event id and status; the document
    # allowed only a single {"status", "event_id"} object.
    events = [
        {"specversion": "1.0", "id": f"o-{n}", "source": "/orders", "type": "t", "data": n}
        for n in (1, 2)
    ]
    body = json.dumps(events).encode()
    headers = {
        "X-Signature": "sha256=" + hmac_hex(body),
        "Content-Type": "application/cloudevents-batch+json",
    }
    first = checked(spec, api.post("/webhooks/ce", data=body, headers=headers))
    assert [e["status"] for e in first.get_json()["events"]] == ["accepted", "accepted"]
    again = checked(spec, api.post("/webhooks/ce", data=body, headers=headers))
    assert [e["status"] for e in again.get_json()["events"]] == ["duplicate", "duplicate"]


def test_cloudevents_validation_handshake_matches_the_document(spec, api):
    # OPTIONS /webhooks/<source> is a route of its own (the CloudEvents
    # webhook handshake), answered 200 or 400; the document had no OPTIONS.
    origin = {"WebHook-Request-Origin": "eventgrid.azure.net", "WebHook-Request-Rate": "120"}
    answer = checked(spec, api.options("/webhooks/ce", headers=origin))
    assert answer.status_code == 200
    assert answer.headers["WebHook-Allowed-Origin"] == "eventgrid.azure.net"
    bad = checked(
        spec,
        api.options("/webhooks/ce", headers={"WebHook-Request-Origin": "a b"}),
        request_too=False,
    )
    assert bad.status_code == 400


def test_every_route_of_the_machine_surfaces_is_in_the_document_and_only_those(api):
    # What the app routes, method by method (Flask's automatic HEAD and
    # OPTIONS aside), against what the document lists.
    doc = api.get("/openapi.json").get_json()
    documented = {(path, method.upper()) for path, ops in doc["paths"].items() for method in ops}
    routed = set()
    for rule in api.application.url_map.iter_rules():
        if rule.endpoint in ("static", "favicon") or rule.rule.startswith("/admin"):
            continue
        if rule.rule == "/problems/":  # the same page as /problems
            continue
        path = rule.rule.replace("<int:event_id>", "{id}").replace("<source_name>", "{source}")
        path = path.replace("<slug>", "{slug}")
        methods = set(rule.methods or ()) - {"HEAD"}
        if getattr(rule, "provide_automatic_options", False):
            methods.discard("OPTIONS")
        routed |= {(path, method) for method in methods}
    assert routed == documented


# Keys the server takes and keys it refuses (400 idempotency-key-invalid).
_KEYS_TAKEN = ["order-42", "a b", "x" * 255, '"order,7"', '"' + "y" * 255 + '"', '"a\\"b"', "?"]
_KEYS_REFUSED = ["caf\u00e9", "a,b", "x" * 256, '"' + "x" * 256 + '"', '"a\\b"', '"a" b', '""']


def _request_is_valid(spec: OpenAPI, response: Any) -> bool:
    try:
        checked(spec, response)
    except Exception:
        return False
    return True


def test_the_documented_idempotency_key_is_the_one_the_server_takes(spec, api):
    # The draft: publish the key's format. A key the document allows is one
    # the server takes, and one it refuses breaks the document.
    for i, key in enumerate(_KEYS_TAKEN):
        response = post_event(api, key, {"type": "t", "data": i})
        assert response.status_code == 201, key
        assert _request_is_valid(spec, response), key
    for key in _KEYS_REFUSED:
        response = post_event(api, key, {"type": "t", "data": key})
        assert response.get_json()["type"] == "/problems/idempotency-key-invalid", key
        assert not _request_is_valid(spec, response), key
    parameter = api.get("/openapi.json").get_json()["paths"]["/api/events"]["post"]
    description = parameter["parameters"][0]["description"]
    # And how long a key is kept (IDEMPOTENCY_TTL_SECONDS' default).
    assert "24 hours" in description, description
