"""What an operator looks for: API events by their Idempotency-Key, replays, labels, the icon."""

from __future__ import annotations

import re

from ..conftest import bearer
from ..helpers import post_event
from .conftest import conflict, event, text

EVENT = {"type": "order.created", "data": 1}


def _listed(response) -> list[int]:
    return [int(n) for n in re.findall(r'data-event-id="(\d+)"', text(response))]


def test_an_api_event_is_found_by_the_idempotency_key_its_client_sent(admin, admin_app):
    api = admin_app.test_client()
    created = post_event(api, "order-42", EVENT).get_json()["id"]
    post_event(api, "order-43", EVENT)
    # A webhook event whose dedup key happens to be the same text is found too.
    webhook = event(admin_app, source="stripe", dedup_key="order-42")
    page = admin.get("/admin/events?q=order-42")
    assert sorted(_listed(page)) == sorted([created, webhook])
    # The list shows the client's key, not the stored random one.
    row = re.search(rf'<tr data-event-id="{created}">(.*?)</tr>', text(page), re.S).group(1)
    assert "order-42" in row


def test_an_idempotency_key_is_not_matched_in_webhook_events_meta(admin, admin_app):
    event(admin_app, source="stripe", dedup_key="evt_1", meta={"idempotency_key": "order-42"})
    assert _listed(admin.get("/admin/events?q=order-42")) == []


def test_the_api_event_page_shows_the_idempotency_key_as_its_key(admin, admin_app):
    created = post_event(admin_app.test_client(), "order-42", EVENT).get_json()["id"]
    page = text(admin.get(f"/admin/events/{created}"))
    assert re.search(r'<dt>Idempotency-Key</dt><dd class="mono" id="key">order-42</dd>', page)
    assert "<dt>Stored key</dt>" in page


def test_replays_of_an_api_event_are_shown_as_its_duplicates(admin, admin_app):
    api = admin_app.test_client()
    created = post_event(api, "order-42", EVENT).get_json()["id"]
    page = text(admin.get(f"/admin/events/{created}"))
    assert "no retry of this Idempotency-Key has been answered" in page
    for _ in range(2):
        assert post_event(api, "order-42", EVENT).headers["Idempotent-Replayed"] == "true"
    assert post_event(api, "order-42", {**EVENT, "data": 2}).status_code == 422  # not a replay
    page = text(admin.get(f"/admin/events/{created}"))
    section = page.split('id="duplicates"', 1)[1].split("</section>", 1)[0]
    assert "retries answered with the saved response" in section
    assert section.count("<li>") == 2
    assert "arrived once" not in page
    assert api.get(f"/api/events/{created}", headers=bearer()).get_json()["duplicate_count"] == 2


def test_the_event_type_is_a_field(admin, admin_app):
    shown = event(admin_app, event_type="invoice.paid")
    page = text(admin.get(f"/admin/events/{shown}"))
    assert '<dt>Type</dt><dd class="event-type">invoice.paid</dd>' in page
    assert re.search(r"<h1>Event \d+</h1>", page)


def test_the_conflict_page_says_which_fingerprint_is_which(admin, admin_app):
    original = event(admin_app)
    conflict_id = conflict(admin_app, original, fingerprint="c" * 64)
    page = text(admin.get(f"/admin/conflicts/{conflict_id}"))
    assert re.search(r"<dt>Original's fingerprint</dt><dd[^>]*>[0-9a-f]{64}</dd>", page)
    assert re.search(r"<dt>Conflicting fingerprint</dt><dd[^>]*>c{64}</dd>", page)


def test_the_overview_says_what_its_conflicts_count(admin):
    page = text(admin.get("/admin/"))
    assert "Dedup-key conflicts" in page
    assert "webhook_receiver_idempotency_key_reuses_total" in page


def test_time_filters_are_iso_text_fields_not_locale_pickers(admin):
    page = text(admin.get("/admin/events?since=2026-01-02T03:04"))
    assert 'type="datetime-local"' not in page
    assert 'name="since" value="2026-01-02 03:04" placeholder="YYYY-MM-DD HH:MM"' in page
    assert "2026-01-02 03:04" in page


def test_a_favicon_is_served_and_linked(anon):
    with anon.get("/favicon.ico") as icon:
        assert icon.status_code == 200
        assert icon.mimetype == "image/svg+xml"
        assert b"<svg" in icon.data
    assert 'rel="icon"' in text(anon.get("/admin/login"))
