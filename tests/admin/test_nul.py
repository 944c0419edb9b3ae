"""A NUL in any admin filter or form field: 400, the admin's error page, and nothing changed.

PostgreSQL's text holds no NUL, and its driver refuses to send one (a 500
before this check); SQLite would only find nothing. Both answer alike.
"""

from __future__ import annotations

import pytest

from webhook_receiver.extensions import db
from webhook_receiver.models import EventConflict

from .conftest import conflict, event, post, rejection, text

FILTERS = [
    "/admin/events?q=%00",
    "/admin/events?q=evt%00_1",
    "/admin/events?source=stripe%00",
    "/admin/events?type=%00",
    "/admin/dead?consumer=%00",
    "/admin/idempotency?client=%00",
    "/admin/idempotency?key=k%00",
    "/admin/rejections?source=%00",
    "/admin/conflicts?view=%00",
    "/admin/events?%00=x",
]


@pytest.mark.parametrize("url", FILTERS)
def test_a_nul_in_a_filter_is_a_400_page(admin_app, admin, url):
    event(admin_app, source="stripe", dedup_key="evt_1")
    rejection(admin_app)
    response = admin.get(url)
    assert response.status_code == 400, text(response)
    assert response.mimetype == "text/html"
    page = text(response)
    assert "400 Bad Request" in page and "NUL" in page
    assert response.headers["Cache-Control"] == "no-store"


def test_the_same_filters_without_the_nul_still_answer(admin_app, admin):
    event(admin_app, source="stripe", dedup_key="evt_1")
    for url in FILTERS:
        assert admin.get(url.replace("%00", "")).status_code == 200, url


def test_a_nul_in_the_review_note_changes_nothing(admin_app, admin):
    conflict_id = conflict(admin_app, event(admin_app))
    url = f"/admin/conflicts/{conflict_id}/review"
    response = post(admin, url, {"note": "provider bug\x00 #12"})
    assert response.status_code == 400
    assert response.mimetype == "text/html" and "NUL" in text(response)
    with admin_app.app_context():
        row = db.session.get(EventConflict, conflict_id)
        assert (row.reviewed_at, row.review_note) == (None, None)
    assert post(admin, url, {"note": "provider bug #12"}).status_code == 302


@pytest.mark.parametrize(
    ("url", "form"),
    [
        ("/admin/deliveries/requeue", {"ids": "1", "next": "/admin/dead\x00"}),
        ("/admin/deliveries/discard", {"ids": "1\x00"}),
        ("/admin/idempotency/1/evict", {"next": "\x00"}),
    ],
)
def test_a_nul_in_any_other_form_is_refused_too(admin_app, admin, url, form):
    assert post(admin, url, form).status_code == 400


def test_the_login_checks_come_first(admin_app, anon):
    # Not logged in: sent to log in, as for any other admin page.
    response = anon.get("/admin/events?q=%00")
    assert response.status_code == 302 and "/admin/login" in response.headers["Location"]
    # A form without its CSRF token is refused for that, before its fields are read.
    assert anon.post("/admin/login", data={"password": "\x00"}).status_code == 400
