"""A page emptied since its link was made does not say the whole list is empty."""

from __future__ import annotations

import re
from datetime import timedelta

from webhook_receiver.models import utcnow

from .conftest import PASSWORD, conflict, delivery, event, login, post, text

_NEXT = re.compile(r'<a href="([^"]+)" rel="next">')


def test_a_dead_letter_page_emptied_by_a_requeue_says_where_the_rest_are(make_app):
    # The operator requeued the whole of page 2: back on it, "No dead
    # deliveries." read as if the backlog were cleared, while page 1 was full.
    app = make_app(ADMIN_PASSWORD=PASSWORD, ADMIN_PAGE_SIZE=3)
    client = app.test_client()
    login(client)
    now = utcnow()
    target = event(app)
    dead = [
        delivery(app, target, consumer=f"c{i}", state="dead", updated_at=now - timedelta(i))
        for i in range(6)
    ]
    older = _NEXT.search(text(client.get("/admin/dead"))).group(1).replace("&amp;", "&")
    post(client, "/admin/deliveries/requeue", {"ids": dead[3:], "next": older})
    page = text(client.get(older))
    assert "No dead deliveries." not in page
    assert "None on this page any more" in page
    # An empty list still says so plainly.
    post(client, "/admin/deliveries/requeue", {"ids": dead[:3]})
    assert "No dead deliveries." in text(client.get("/admin/dead"))


def test_a_conflict_page_emptied_by_reviews_says_where_the_rest_are(make_app):
    app = make_app(ADMIN_PASSWORD=PASSWORD, ADMIN_PAGE_SIZE=2)
    client = app.test_client()
    login(client)
    now = utcnow()
    target = event(app)
    ids = [conflict(app, target, received_at=now - timedelta(minutes=i)) for i in range(4)]
    older = _NEXT.search(text(client.get("/admin/conflicts"))).group(1).replace("&amp;", "&")
    for conflict_id in ids[2:]:
        post(client, f"/admin/conflicts/{conflict_id}/review", {"note": "seen", "reviewed": ""})
    page = text(client.get(older))
    assert "No unreviewed conflicts." not in page
    assert "None on this page any more" in page
