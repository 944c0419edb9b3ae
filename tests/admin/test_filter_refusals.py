"""A list filter that names nothing is a 400 page saying which, never a list to believe.

An operator who mistyped a state, a date, a source, a consumer or a client
saw an empty list (or, for a state the page did not know, the unfiltered
list) and took it for the answer. Each such filter is now answered with
the list's page, empty, with what is wrong (HTML, 400), and changes nothing.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from flask import Flask

from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery, Replay, utcnow

from .conftest import (
    conflict,
    delivery,
    event,
    idempotency_record,
    post,
    rejection,
    text,
)


@pytest.fixture
def stored(admin_app: Flask) -> dict[str, int]:
    """One row of each list, by a source, consumer and client the lists can be filtered on."""
    evt = event(admin_app, source="stripe")
    return {
        "event": evt,
        "dead": delivery(admin_app, evt, consumer="billing", state="dead", attempts=8),
        "conflict": conflict(admin_app, evt),
        "rejection": rejection(admin_app, source="stripe"),
        "key": idempotency_record(admin_app, client="acme", key="k-1"),
    }


def refused(response, *said: str) -> str:
    page = text(response)
    assert response.status_code == 400, page[:500]
    assert response.mimetype == "text/html"
    for words in said:
        assert words in page, (words, page[:2000])
    return page


REFUSED = [
    # (URL, what the page must say)
    ("/admin/events?state=lost", "Unknown state “lost”: choose one of pending"),
    ("/admin/events?since=yesterday", "“yesterday” is not a date and time"),
    ("/admin/events?until=2026-13-01", "“2026-13-01” is not a date and time"),
    ("/admin/events?source=strpie", "Unknown source “strpie”"),
    (
        "/admin/events?since=2026-05-02&until=2026-05-01",
        "“From” (2026-05-02) is after “Until” (2026-05-01)",
    ),
    ("/admin/events?before=-1", "That page link is not valid"),
    ("/admin/events?after=abc", "That page link is not valid"),
    ("/admin/deliveries?state=lost", "Unknown state “lost”: choose one of"),
    ("/admin/deliveries?consumer=biling", "Unknown consumer “biling”"),
    ("/admin/deliveries?source=strpie", "Unknown source “strpie”"),
    ("/admin/deliveries?type=invoice.payed", "Unknown event type “invoice.payed”"),
    ("/admin/events?type=invoice.payed", "Unknown event type “invoice.payed”"),
    ("/admin/deliveries?since=2026-02-30", "is not a date and time"),
    ("/admin/deliveries?limit=-5", "The limit must be a number from 1 to 100,000."),
    ("/admin/deliveries?limit=ten", "The limit must be a number from 1 to 100,000."),
    ("/admin/deliveries?before=1.-2", "That page link is not valid"),
    ("/admin/deliveries/replay?state=lost", "Unknown state “lost”"),
    ("/admin/deliveries/replay?consumer=biling", "Unknown consumer “biling”"),
    ("/admin/deliveries/replay?limit=0", "The limit must be a number from 1 to 100,000."),
    ("/admin/deliveries/replay?since=soon", "“soon” is not a date and time"),
    ("/admin/dead?consumer=biling", "Unknown consumer “biling”"),
    ("/admin/dead?before=x.1", "That page link is not valid"),
    ("/admin/conflicts?view=unreveiwed", "Unknown view “unreveiwed”: choose one of unreviewed"),
    ("/admin/conflicts?after=1.x", "That page link is not valid"),
    ("/admin/rejections?source=strpie", "Unknown source “strpie”"),
    ("/admin/rejections?before=%E2%91%A0.1", "That page link is not valid"),
    ("/admin/idempotency?state=runing", "Unknown state “runing”: choose one of in_progress"),
    ("/admin/idempotency?client=acmee", "Unknown client “acmee”"),
    ("/admin/replays?before=1.99999999999999999999", "That page link is not valid"),
]


@pytest.mark.parametrize(("url", "said"), REFUSED, ids=[url for url, _ in REFUSED])
def test_a_filter_that_names_nothing_is_a_400_page_saying_which(admin, stored, url, said):
    page = refused(admin.get(url), said)
    # No row is shown as if it were what the filter matched.
    assert f'data-event-id="{stored["event"]}"' not in page
    assert f'data-delivery-id="{stored["dead"]}"' not in page
    assert f'data-record-id="{stored["key"]}"' not in page
    assert f'data-conflict-id="{stored["conflict"]}"' not in page


def test_the_list_pages_keep_their_form_to_fix_the_filter(admin, stored):
    # The list's own page, its form holding what was typed, not a bare error.
    page = refused(admin.get("/admin/dead?consumer=biling"), 'value="biling"')
    assert 'action="/admin/dead"' in page
    page = refused(admin.get("/admin/rejections?source=strpie"), 'value="strpie"')
    page = refused(admin.get("/admin/events?source=strpie&type=x"), 'value="strpie"')
    assert 'class="flash flash-error"' in page


def test_a_bulk_replay_with_a_bad_filter_is_refused_not_sent_to_the_whole_list(
    admin_app, admin, stored
):
    # The preview sent the operator back to the Deliveries list unfiltered,
    # where the dead delivery showed as though it were what matched.
    response = admin.get("/admin/deliveries/replay?state=dead&consumer=biling")
    page = refused(response, "Unknown consumer “biling”", 'value="biling"')
    assert "Location" not in response.headers
    assert 'id="replay-count"' not in page
    for form in (
        {"consumer": "biling", "count": "1", "up_to": str(stored["dead"])},
        {"source": "strpie", "count": "1", "up_to": str(stored["dead"])},
        {
            "since": "2026-05-02",
            "until": "2026-05-01",
            "count": "1",
            "up_to": str(stored["dead"]),
        },
    ):
        response = post(admin, "/admin/deliveries/replay", {**form, "confirm": "yes"})
        assert response.status_code == 400
    with admin_app.app_context():
        assert db.session.query(Replay).count() == 0
        assert db.session.get(Delivery, stored["dead"]).state == "dead"


def test_known_and_stored_names_are_still_filters(admin_app, admin, stored):
    # Configured (the acme client, its api:acme source) or only stored (a
    # source or consumer since removed from the file): both filter.
    ok = [
        "/admin/events?source=stripe",
        "/admin/events?type=invoice.paid&state=none",
        "/admin/deliveries?type=invoice.paid",
        "/admin/events?source=api:acme",
        "/admin/events?state=dead&since=2000-01-01&until=2000-01-01",
        "/admin/deliveries?consumer=billing&source=stripe&state=dead",
        "/admin/deliveries/replay?consumer=billing&state=dead",
        "/admin/dead?consumer=billing",
        "/admin/conflicts?view=all",
        "/admin/conflicts?view=",
        "/admin/rejections?source=stripe",
        "/admin/idempotency?client=globex&state=expired",
        "/admin/idempotency?state=",
        "/admin/replays",
    ]
    for url in ok:
        response = admin.get(url)
        assert response.status_code == 200, (url, text(response)[:500])
        assert "flash-error" not in text(response), url
    assert f'data-delivery-id="{stored["dead"]}"' in text(admin.get("/admin/dead?consumer=billing"))
    # A source configured but without events yet is a filter too (nothing yet).
    assert admin.get("/admin/events?source=api:globex").status_code == 200


def test_an_inverted_range_is_refused_where_an_equal_one_is_not(admin, stored):
    moment = (utcnow() - timedelta(days=1)).strftime("%Y-%m-%d %H:%M")
    assert admin.get(f"/admin/events?since={moment}&until={moment}").status_code == 200
