"""What binds an Idempotency-Key: a request refused before the view began binds nothing.

As Stripe saves a result only once an endpoint began executing, a body that
does not parse or validate (400), one over the size limit (413) and one of a
media type the view cannot read (415) leave no record and no claim: the
client that fixes its request and retries with the same key gets its 201,
and its retries the replay of that 201. A 4xx a view decides after it began
its work is saved and replayed, as before.

The real ``POST /api/events`` view runs on every path: as the app serves it
(one commit, speculative), and wrapped again for this test: speculative
with a fresh count of taken keys (so the key is not read first: the app's
own count is the process's, moved by other tests), one commit reading the
key first, and two phases (the claim committed first, under a lease).
"""

from __future__ import annotations

import inspect
import io
import json
from typing import Any
from unittest.mock import patch

import pytest
from flask import Blueprint, Flask, request
from flask.testing import FlaskClient
from werkzeug.exceptions import UnsupportedMediaType

from webhook_receiver.api.auth import require_client
from webhook_receiver.extensions import db
from webhook_receiver.idempotency import idempotent
from webhook_receiver.idempotency.persistence import records
from webhook_receiver.models import Event, IdempotencyRecord
from webhook_receiver.problems import Problem

from ..conftest import bearer
from ..helpers import count, event_row, post_event

LIMIT = 4096
GOOD = {"type": "order.created", "data": {"order": 42}}
JSON = "application/json"
PATHS = {
    "api": "/api/events",
    "speculative": "/api/t/events/speculative",
    "one_commit": "/api/t/events/one-commit",
    "two_phase": "/api/t/events/two-phase",
}


def _write_event() -> None:
    db.session.execute(Event.__table__.insert().values(event_row(event_type="partial")))


def refusals_blueprint(app: Flask) -> Blueprint:
    bp = Blueprint("refusals_test", __name__)
    # The view itself, from under @require_client and @idempotent(speculative=True).
    create_event = inspect.unwrap(app.view_functions["api.create_event"])
    bp.add_url_rule(
        PATHS["speculative"],
        "speculative",
        require_client(idempotent(speculative=True)(create_event)),
        methods=["POST"],
    )
    bp.add_url_rule(
        PATHS["one_commit"],
        "one_commit",
        require_client(idempotent()(create_event)),
        methods=["POST"],
    )
    bp.add_url_rule(
        PATHS["two_phase"],
        "two_phase",
        require_client(idempotent(two_phase=True)(create_event)),
        methods=["POST"],
    )

    # A 4xx after the work began: saved and replayed, whatever the body.
    def write_then_refuse() -> Any:
        _write_event()
        raise Problem("invalid-event", "refused after a write")

    # Werkzeug's own 415 from reading the body: refused before any work.
    def reads_json() -> Any:
        return {"got": request.get_json()}, 201

    # A 415 problem of the view's own: refused as well, however raised.
    def checks_media_type() -> Any:
        if request.mimetype != JSON:
            raise Problem("unsupported-media-type", "send JSON")
        return {"got": request.get_json()}, 201

    for mode in ("one_commit", "two_phase"):
        two_phase = mode == "two_phase"
        bp.add_url_rule(
            f"/api/t/write-then-refuse/{mode}",
            f"write_then_refuse_{mode}",
            require_client(idempotent(two_phase=two_phase)(write_then_refuse)),
            methods=["POST"],
        )
        for name, view in (("reads-json", reads_json), ("checks-media-type", checks_media_type)):
            bp.add_url_rule(
                f"/api/t/{name}/{mode}",
                f"{name}_{mode}",
                require_client(idempotent(two_phase=two_phase)(view)),
                methods=["POST"],
            )
    return bp


@pytest.fixture
def app(make_app: Any) -> Flask:
    app = make_app(PROPAGATE_EXCEPTIONS=False, MAX_BODY_BYTES=LIMIT)
    app.register_blueprint(refusals_blueprint(app))
    return app


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest) -> str:
    return PATHS[request.param]


def post(
    client: FlaskClient,
    path: str,
    data: Any = None,
    key: str = "k1",
    content_type: str = JSON,
    **kwargs: Any,
) -> Any:
    body = GOOD if data is None else data
    return post_event(client, key, body, path=path, content_type=content_type, **kwargs)


def stored(app: Flask) -> tuple[int, int]:
    """The number of events and of idempotency records (claims included)."""
    return count(app), count(app, IdempotencyRecord)


def the_corrected_request_gets_its_201(app: Flask, client: FlaskClient, path: str) -> None:
    """The same key, now with a good body: created, then replayed."""
    created = post(client, path)
    assert created.status_code == 201, created.get_data(as_text=True)
    assert "Idempotent-Replayed" not in created.headers
    assert created.get_json()["data"] == GOOD["data"]
    again = post(client, path)
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == created.get_data()
    assert stored(app) == (1, 1)


REFUSED_BODIES = [
    pytest.param(b'{"type":"x",', JSON, 400, "invalid-json", id="400-bad-json"),
    pytest.param(b'{"type":"x","data":1e400}', JSON, 400, "invalid-json", id="400-data-1e400"),
    pytest.param(b'{"type":"x","type":"y","data":1}', JSON, 400, "invalid-json", id="400-dup"),
    pytest.param(b'{"type":5,"data":1}', JSON, 400, "invalid-event", id="400-type-not-a-string"),
    pytest.param(b'{"type":"x"}', JSON, 400, "invalid-event", id="400-no-data"),
    pytest.param(b"[1,2]", JSON, 400, "invalid-event", id="400-not-an-object"),
    pytest.param(
        json.dumps(GOOD).encode(), "text/plain", 415, "unsupported-media-type", id="415-not-json"
    ),
    pytest.param(
        json.dumps(GOOD).encode(),
        "application/json; x=" + "a" * 300,
        415,
        "unsupported-media-type",
        id="415-content-type-too-long",
    ),
    pytest.param(
        json.dumps({"type": "big", "data": "x" * LIMIT}).encode(),
        JSON,
        413,
        "payload-too-large",
        id="413-content-length",
    ),
]


@pytest.mark.parametrize(("body", "content_type", "status", "slug"), REFUSED_BODIES)
def test_a_refused_request_binds_nothing_and_the_corrected_one_gets_its_201(
    app: Flask, path: str, body: bytes, content_type: str, status: int, slug: str
) -> None:
    client = app.test_client()
    refused = post(client, path, body, content_type=content_type)
    assert refused.status_code == status, refused.get_data(as_text=True)
    assert refused.mimetype == "application/problem+json"
    assert refused.get_json()["type"] == f"/problems/{slug}"
    assert "Idempotent-Replayed" not in refused.headers
    assert stored(app) == (0, 0)  # no record, no claim left behind
    # Sent again as it was, it is refused again, not replayed.
    assert "Idempotent-Replayed" not in post(client, path, body, content_type=content_type).headers
    the_corrected_request_gets_its_201(app, client, path)


def test_a_chunked_body_over_the_limit_binds_nothing(app: Flask, path: str) -> None:
    client = app.test_client()
    big = json.dumps({"type": "big", "data": "x" * LIMIT * 2}).encode()
    # No Content-Length: read up front and refused before the view (problems.py).
    refused = client.post(
        path,
        input_stream=io.BytesIO(big),
        content_type=JSON,
        headers={**bearer(), "Idempotency-Key": "k1"},
        environ_overrides={"wsgi.input_terminated": True},
    )
    assert refused.status_code == 413, refused.get_data(as_text=True)
    assert stored(app) == (0, 0)
    the_corrected_request_gets_its_201(app, client, path)


def test_a_refused_body_under_a_used_key_is_422_on_every_path(app: Flask, path: str) -> None:
    client = app.test_client()
    assert post(client, path).status_code == 201
    # The key's record wins over the refusal, read first or not.
    for body in (b'{"type":"x","data":1e400}', b"[1,2]"):
        response = post(client, path, body)
        assert response.status_code == 422
        assert response.get_json()["type"] == "/problems/idempotency-key-reused"
    assert stored(app) == (1, 1)
    assert post(client, path).headers["Idempotent-Replayed"] == "true"


def test_on_the_speculative_path_only_a_refusal_pays_a_read(app: Flask) -> None:
    client = app.test_client()
    with patch.object(records, "find", wraps=records.find) as find:
        assert post(client, PATHS["speculative"], b"{").status_code == 400
    # Read once, after the refusal, to answer a retry from its record.
    assert find.call_count == 1
    with patch.object(records, "find", wraps=records.find) as find:
        assert post(client, PATHS["speculative"]).status_code == 201
    assert find.call_count == 0  # the success path gained no round trip


@pytest.mark.parametrize("mode", ["one_commit", "two_phase"])
def test_a_4xx_decided_after_the_work_began_is_saved_and_replayed(app: Flask, mode: str) -> None:
    client = app.test_client()
    path = f"/api/t/write-then-refuse/{mode}"
    first = post(client, path)
    assert first.status_code == 400
    assert stored(app) == (0, 1)  # its write rolled back; its answer saved
    again = post(client, path)
    assert (again.status_code, again.headers["Idempotent-Replayed"]) == (400, "true")
    assert again.get_data() == first.get_data()
    # Another body under the key is another request: 422, not a fresh run.
    assert post(client, path, {"type": "x", "data": 2}).status_code == 422


@pytest.mark.parametrize("view", ["reads-json", "checks-media-type"])
@pytest.mark.parametrize("mode", ["one_commit", "two_phase"])
def test_a_415_raised_by_a_view_binds_nothing(app: Flask, mode: str, view: str) -> None:
    client = app.test_client()
    path = f"/api/t/{view}/{mode}"
    refused = post(client, path, b"{}", content_type="text/plain")
    assert refused.status_code == UnsupportedMediaType.code
    assert refused.mimetype == "application/problem+json"
    assert stored(app) == (0, 0)
    created = post(client, path, b"{}")
    assert (created.status_code, created.get_json()) == (201, {"got": {}})
    assert post(client, path, b"{}").headers["Idempotent-Replayed"] == "true"
