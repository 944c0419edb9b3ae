"""Every state-changing admin request needs its CSRF token: without one, 400 and no change."""

from __future__ import annotations

import pytest
from flask import Flask
from flask.testing import FlaskClient

from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery, EventConflict, IdempotencyRecord

from .conftest import PASSWORD, conflict, csrf_token, delivery, event, idempotency_record, login


@pytest.fixture(params=[True, False], ids=["csrf-enabled", "csrf-flag-off"])
def strict_app(request, make_app) -> Flask:
    """The admin with WTF_CSRF_ENABLED set explicitly (Flask-WTF relaxes it for tests otherwise).

    The admin checks its tokens even when the flag is off: a mistaken setting
    must not leave it open.
    """
    return make_app(ADMIN_PASSWORD=PASSWORD, WTF_CSRF_ENABLED=request.param)


@pytest.fixture
def logged_in(strict_app) -> FlaskClient:
    client = strict_app.test_client()
    assert login(client).status_code == 302
    return client


@pytest.fixture(params=["missing", "invalid", "other-session"])
def bad_token(request, strict_app) -> dict[str, str]:
    if request.param == "missing":
        return {}
    if request.param == "invalid":
        return {"csrf_token": "not-a-token"}
    # A valid token, but minted for somebody else's session.
    return {"csrf_token": csrf_token(strict_app.test_client())}


@pytest.mark.parametrize(
    "action, fields",
    [("requeue", {}), ("discard", {"confirm": "yes"})],
)
def test_delivery_action_without_token_changes_nothing(
    strict_app, logged_in, bad_token, action, fields
):
    delivery_id = delivery(strict_app, event(strict_app), state="dead", attempts=5)
    response = logged_in.post(
        f"/admin/deliveries/{action}", data={"ids": [delivery_id], **fields, **bad_token}
    )
    assert response.status_code == 400
    assert "nothing was changed" in response.get_data(as_text=True)
    with strict_app.app_context():
        row = db.session.get(Delivery, delivery_id)
        assert (row.state, row.attempts) == ("dead", 5)


def test_review_without_token_changes_nothing(strict_app, logged_in, bad_token):
    conflict_id = conflict(strict_app, event(strict_app))
    response = logged_in.post(
        f"/admin/conflicts/{conflict_id}/review", data={"note": "done", **bad_token}
    )
    assert response.status_code == 400
    with strict_app.app_context():
        row = db.session.get(EventConflict, conflict_id)
        assert row.reviewed_at is None and row.review_note is None


def test_evict_without_token_changes_nothing(strict_app, logged_in, bad_token):
    record_id = idempotency_record(strict_app)
    response = logged_in.post(f"/admin/idempotency/{record_id}/evict", data=bad_token)
    assert response.status_code == 400
    with strict_app.app_context():
        assert db.session.get(IdempotencyRecord, record_id) is not None


def test_logout_without_token_keeps_the_session(logged_in, bad_token):
    assert logged_in.post("/admin/logout", data=bad_token).status_code == 400
    assert logged_in.get("/admin/").status_code == 200


def test_login_without_token_is_refused(strict_app, bad_token):
    client = strict_app.test_client()
    client.get("/admin/login")
    response = client.post("/admin/login", data={"password": PASSWORD, **bad_token})
    assert response.status_code == 400
    assert response.mimetype == "text/html"
    assert client.get("/admin/").status_code == 302


def test_token_in_header_is_accepted(strict_app, logged_in):
    record_id = idempotency_record(strict_app)
    token = csrf_token(logged_in, "/admin/")
    response = logged_in.post(
        f"/admin/idempotency/{record_id}/evict",
        data={"confirm": "yes"},
        headers={"X-CSRFToken": token},
    )
    assert response.status_code == 302
    with strict_app.app_context():
        assert db.session.get(IdempotencyRecord, record_id) is None


def test_unauthenticated_post_with_token_is_forbidden(strict_app):
    client = strict_app.test_client()
    record_id = idempotency_record(strict_app)
    token = csrf_token(client)
    response = client.post(f"/admin/idempotency/{record_id}/evict", data={"csrf_token": token})
    assert response.status_code == 403
    with strict_app.app_context():
        assert db.session.get(IdempotencyRecord, record_id) is not None
