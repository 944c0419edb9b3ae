"""Whatever a sender put in a payload or header is shown as text, never run as markup."""

from __future__ import annotations

from .conftest import conflict, delivery, event, idempotency_record, post, rejection, text

SCRIPT = "<script>alert(1)</script>"
IMG = '"><img src=x onerror=alert(1)>'


def assert_inert(page: str) -> None:
    assert "<script" not in page
    assert "<img" not in page
    assert "onerror=alert(1)>" not in page


def test_json_body_and_header_values_are_escaped(admin_app, admin):
    event_id = event(
        admin_app,
        body=('{"note": "' + SCRIPT + '"}').encode(),
        headers=[["X-Evil", IMG], [IMG, "name too"]],
        event_type=SCRIPT,
        dedup_key=IMG,
        correlation_id=SCRIPT,
    )
    delivery(admin_app, event_id, state="dead", last_error=SCRIPT, consumer=IMG)
    page = text(admin.get(f"/admin/events/{event_id}"))
    assert_inert(page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in page


def test_raw_text_body_is_escaped(admin_app, admin):
    event_id = event(admin_app, body=SCRIPT.encode(), content_type="text/html")
    page = text(admin.get(f"/admin/events/{event_id}"))
    assert_inert(page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_list_pages_escape_what_they_show(admin_app, admin):
    event_id = event(admin_app, event_type=SCRIPT, dedup_key=IMG, source=SCRIPT)
    delivery(admin_app, event_id, state="dead", last_error=SCRIPT, consumer=IMG)
    conflict(admin_app, event_id, body=SCRIPT.encode(), content_type="text/plain")
    rejection(admin_app, source=SCRIPT, detail=IMG, remote_addr=SCRIPT[:50])
    idempotency_record(admin_app, client=SCRIPT, key=IMG)
    for url in [
        "/admin/events",
        f"/admin/events?source={SCRIPT}&q={IMG}",
        "/admin/dead",
        "/admin/conflicts",
        "/admin/rejections",
        "/admin/idempotency",
        f"/admin/idempotency?client={SCRIPT}",
    ]:
        response = admin.get(url)
        assert response.status_code == 200, url
        assert_inert(text(response))


def test_conflict_diff_and_review_note_are_escaped(admin_app, admin):
    event_id = event(admin_app, body=b"<b>old</b>", content_type="text/html")
    conflict_id = conflict(
        admin_app, event_id, body=SCRIPT.encode(), content_type="text/html", headers=[["X", IMG]]
    )
    post(admin, f"/admin/conflicts/{conflict_id}/review", {"note": IMG + SCRIPT})
    page = text(admin.get(f"/admin/conflicts/{conflict_id}"))
    assert_inert(page)
    assert "<b>old" not in page
    assert (
        "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in page
    )


def test_flash_messages_and_next_values_are_escaped(admin_app, anon):
    response = anon.get(f"/admin/login?next=/admin/events?q={IMG}")
    assert_inert(text(response))
