"""A stored body can be had whole, as it was received, from the event and conflict pages.

The event page shows a binary body's first 4,096 bytes and lays a text body
out whole; the rest of a binary body, up to MAX_BODY_BYTES, was nowhere, and
a large text body made the page as large. Each body is now a download,
byte for byte, and a large text body is shown as its first part.
"""

from __future__ import annotations

from webhook_receiver.admin.presenters import SHOWN_LIMIT

from .conftest import conflict, event, text

BINARY = bytes(range(256)) * 40  # 10,240 bytes, NULs and all: past the hex dump's 4,096


def _downloaded(response, body: bytes) -> None:
    assert response.status_code == 200
    assert response.get_data() == body
    assert response.mimetype == "application/octet-stream"
    assert response.headers["Content-Disposition"].startswith("attachment;")
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Cache-Control"] == "no-store"


def test_an_events_whole_body_downloads_as_received(admin_app, admin):
    event_id = event(admin_app, body=BINARY, content_type="application/octet-stream")
    page = text(admin.get(f"/admin/events/{event_id}"))
    assert "(the first 4096)" in page
    link = f"/admin/events/{event_id}/body"
    assert f'href="{link}"' in page
    response = admin.get(link)
    _downloaded(response, BINARY)
    assert f'filename="event-{event_id}.body"' in response.headers["Content-Disposition"]


def test_a_conflicts_bodies_download_as_received(admin_app, admin):
    event_id = event(admin_app, body=b'{"amount": 1}')
    conflict_id = conflict(admin_app, event_id, body=BINARY, content_type="image/png")
    page = text(admin.get(f"/admin/conflicts/{conflict_id}"))
    assert f'href="/admin/conflicts/{conflict_id}/body"' in page
    assert f'href="/admin/events/{event_id}/body"' in page
    _downloaded(admin.get(f"/admin/conflicts/{conflict_id}/body"), BINARY)
    _downloaded(admin.get(f"/admin/events/{event_id}/body"), b'{"amount": 1}')


def test_a_body_download_needs_a_login_and_a_known_id(admin_app, admin, anon):
    event_id = event(admin_app, body=b"secret")
    response = anon.get(f"/admin/events/{event_id}/body")
    assert response.status_code == 302 and "/admin/login" in response.headers["Location"]
    assert anon.get("/admin/conflicts/1/body").status_code == 302
    assert admin.get(f"/admin/events/{event_id + 1000}/body").status_code == 404
    assert admin.get("/admin/conflicts/999999/body").status_code == 404


def test_a_text_body_past_the_shown_limit_is_shown_as_its_first_part(admin_app, admin):
    # UTF-8 whose cut falls inside a character: that character is left out, not mangled.
    body = ("é" * (SHOWN_LIMIT // 2 + 10)).encode()
    event_id = event(admin_app, body=body, content_type="text/plain; charset=utf-8")
    page = text(admin.get(f"/admin/events/{event_id}"))
    assert f"its first {SHOWN_LIMIT} bytes, as text" in page
    assert page.count("é") == SHOWN_LIMIT // 2
    assert "\ufffd" not in page
    _downloaded(admin.get(f"/admin/events/{event_id}/body"), body)
