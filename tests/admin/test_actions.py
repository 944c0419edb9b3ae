"""The admin's actions: requeue, review a conflict, evict a key; and the lists they start from."""

from __future__ import annotations

import json
import random
import re
from datetime import timedelta

import pytest
from sqlalchemy import func

from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery, Event, EventConflict, IdempotencyRecord, utcnow

from .conftest import (
    NOW,
    PASSWORD,
    conflict,
    csrf_token,
    delivery,
    event,
    idempotency_record,
    login,
    post,
    rejection,
    text,
)

CONFIRM = {"confirm": "yes"}


def state_of(app, delivery_id):
    with app.app_context():
        row = db.session.get(Delivery, delivery_id)
        return row.state, row.attempts


# -- requeue -----------------------------------------------------------------


def test_requeue_one_from_the_event_page(admin_app, admin):
    event_id = event(admin_app)
    dead_id = delivery(
        admin_app, event_id, state="dead", attempts=8, updated_at=utcnow() - timedelta(hours=1)
    )
    page = f"/admin/events/{event_id}"
    response = post(admin, "/admin/deliveries/requeue", {"ids": dead_id, "next": page})
    assert response.status_code == 302
    assert response.headers["Location"] == page
    assert state_of(admin_app, dead_id) == ("pending", 0)
    html = text(admin.get(page))
    assert "Requeued 1 delivery." in html
    row = html[html.index(f'data-delivery-id="{dead_id}"') :].split("</tr>")[0]
    assert "state-pending" in row and "Requeue" not in row


def test_dead_letters_list_and_requeue_many(admin_app, admin):
    event_id = event(admin_app, source="github", event_type="push")
    now = utcnow()
    dead = [
        delivery(
            admin_app,
            event_id,
            consumer=f"c{i}",
            state="dead",
            attempts=8,
            last_error=f"error {i}",
            updated_at=now - timedelta(minutes=i),
        )
        for i in range(3)
    ]
    delivery(admin_app, event_id, consumer="fine", state="delivered")
    listing = text(admin.get("/admin/dead"))
    assert [int(i) for i in re.findall(r'data-delivery-id="(\d+)"', listing)] == dead
    assert "error 1" in listing and "github" in listing
    response = post(
        admin, "/admin/deliveries/requeue", {"ids": [dead[0], dead[2]], "next": "/admin/dead"}
    )
    assert response.status_code == 302
    assert response.headers["Location"] == "/admin/dead"
    assert [state_of(admin_app, d)[0] for d in dead] == ["pending", "dead", "pending"]
    assert "Requeued 2 deliveries." in text(admin.get("/admin/dead"))


def test_requeue_all_on_the_page(admin_app, admin):
    event_id = event(admin_app)
    dead = [delivery(admin_app, event_id, consumer=f"c{i}", state="dead") for i in range(3)]
    page = text(admin.get("/admin/dead"))
    value = re.search(r'name="page_ids" value="([\d,]+)"', page).group(1)
    assert sorted(int(i) for i in value.split(",")) == dead
    post(admin, "/admin/deliveries/requeue", {"page_ids": value})
    assert {state_of(admin_app, d)[0] for d in dead} == {"pending"}
    assert "No dead deliveries." in text(admin.get("/admin/dead"))


def _dead_shown(response) -> list[int]:
    assert response.status_code == 200
    return [int(i) for i in re.findall(r'data-delivery-id="(\d+)"', text(response))]


def _pager_links(response) -> dict[str, str]:
    found = re.findall(r'<a href="([^"]+)" rel="(next|prev)">', text(response))
    return {rel: href.replace("&amp;", "&") for href, rel in found}


def test_a_page_emptied_by_requeueing_links_back_to_every_row_left(make_app):
    # A page's links start past the row at its edge. Once the rows of a page
    # were requeued, the emptied page linked past its own cursor's row: that
    # dead delivery showed on neither side.
    app = make_app(ADMIN_PASSWORD=PASSWORD, ADMIN_PAGE_SIZE=3)
    client = app.test_client()
    assert login(client).status_code == 302
    now = utcnow()
    event_id = event(app)
    dead = [
        delivery(app, event_id, consumer=f"c{i}", state="dead", updated_at=now - timedelta(i))
        for i in range(6)
    ]
    first = client.get("/admin/dead")
    assert _dead_shown(first) == dead[:3]
    older = _pager_links(first)["next"]
    second = client.get(older)
    assert _dead_shown(second) == dead[3:]
    newer = _pager_links(second)["prev"]

    # The older page's rows requeued: its "newer" link shows the first page whole.
    post(client, "/admin/deliveries/requeue", {"ids": dead[3:]})
    emptied = client.get(older)
    assert _dead_shown(emptied) == []
    assert _dead_shown(client.get(_pager_links(emptied)["prev"])) == dead[:3]

    # The newer page's rows requeued: the emptied page's "older" link shows them all.
    for i in (3, 4, 5):
        with app.app_context():
            row = db.session.get(Delivery, dead[i])
            row.state, row.updated_at = "dead", now - timedelta(i)
            db.session.commit()
    post(client, "/admin/deliveries/requeue", {"ids": dead[:3]})
    emptied = client.get(newer)
    assert _dead_shown(emptied) == []
    assert _dead_shown(client.get(_pager_links(emptied)["next"])) == dead[3:]


def test_dead_letters_filter_by_consumer(admin_app, admin):
    event_id = event(admin_app)
    crm = delivery(admin_app, event_id, consumer="crm", state="dead")
    delivery(admin_app, event_id, consumer="billing", state="dead")
    page = text(admin.get("/admin/dead?consumer=crm"))
    assert re.findall(r'data-delivery-id="(\d+)"', page) == [str(crm)]


def test_requeue_leaves_delivered_and_working_ones_alone(admin_app, admin):
    event_id = event(admin_app)
    now = utcnow()
    done = delivery(admin_app, event_id, consumer="done", state="delivered", attempts=1)
    working = delivery(
        admin_app,
        event_id,
        consumer="working",
        state="in_progress",
        attempts=1,
        lease_expires_at=now + timedelta(minutes=5),
    )
    stuck = delivery(
        admin_app,
        event_id,
        consumer="stuck",
        state="in_progress",
        attempts=3,
        lease_expires_at=now - timedelta(minutes=5),
    )
    post(admin, "/admin/deliveries/requeue", {"ids": [done, working, stuck, 999999]})
    assert state_of(admin_app, done) == ("delivered", 1)
    assert state_of(admin_app, working) == ("in_progress", 1)
    assert state_of(admin_app, stuck) == ("pending", 0)
    assert "Requeued 1 delivery. 3 could not be requeued" in text(admin.get("/admin/dead"))


def test_requeue_refuses_junk_and_foreign_redirects(admin_app, admin):
    assert post(admin, "/admin/deliveries/requeue", {"ids": "1; drop"}).status_code == 400
    response = post(admin, "/admin/deliveries/requeue", {"next": "https://evil.example/"})
    assert response.headers["Location"] == "/admin/dead"
    assert "Nothing was selected." in text(admin.get("/admin/dead"))


@pytest.mark.parametrize("action", ["requeue", "discard"])
def test_more_ids_than_a_page_holds_are_a_400_and_change_nothing(admin_app, admin, action):
    # A page shows at most 500; a form posted by hand with tens of thousands
    # passed every id to one IN (...): PostgreSQL's driver refused past
    # 65,535 parameters, answered as the database being away (503).
    # (Past the admin's 64 KiB form limit, such a form is now a 413 before
    # it is read.)
    dead = delivery(admin_app, event(admin_app), state="dead")
    for how_many, status in ((501, 400), (5_000, 400), (70_000, 413)):
        ids = ",".join(str(dead + n) for n in range(how_many))
        response = post(admin, f"/admin/deliveries/{action}", {"page_ids": ids, **CONFIRM})
        assert response.status_code == status, response.status_code
        if status == 400:
            assert "at most 500" in text(response)
    assert state_of(admin_app, dead)[0] == "dead"


# -- discard -----------------------------------------------------------------


def test_discard_moves_only_dead_deliveries(admin_app, admin):
    event_id = event(admin_app)
    now = utcnow()
    dead = delivery(
        admin_app,
        event_id,
        consumer="gone",
        state="dead",
        attempts=8,
        last_error="consumer 'gone' is no longer configured",
    )
    pending = delivery(admin_app, event_id, consumer="retrying", state="pending", attempts=2)
    working = delivery(
        admin_app,
        event_id,
        consumer="working",
        state="in_progress",
        attempts=1,
        lease_expires_at=now + timedelta(minutes=5),
    )
    done = delivery(admin_app, event_id, consumer="done", state="delivered", attempts=1)
    response = post(
        admin,
        "/admin/deliveries/discard",
        {"ids": [dead, pending, working, done, 999999], "next": "/admin/dead", **CONFIRM},
    )
    assert response.status_code == 302
    assert response.headers["Location"] == "/admin/dead"
    assert state_of(admin_app, dead) == ("discarded", 8)
    assert state_of(admin_app, pending) == ("pending", 2)
    assert state_of(admin_app, working) == ("in_progress", 1)
    assert state_of(admin_app, done) == ("delivered", 1)
    with admin_app.app_context():
        row = db.session.get(Delivery, dead)
        # Why it died stays readable; when it was discarded is recorded.
        assert row.last_error == "consumer 'gone' is no longer configured"
        assert row.completed_at is not None and row.completed_at >= now
    page = text(admin.get("/admin/dead"))
    assert "Discarded 1 delivery. 4 could not be discarded" in page
    assert "No dead deliveries." in page


def test_discard_all_on_the_page(admin_app, admin):
    event_id = event(admin_app)
    dead = [delivery(admin_app, event_id, consumer=f"c{i}", state="dead") for i in range(3)]
    page = text(admin.get("/admin/dead"))
    discard_form = page[page.index('id="discard"') :]
    value = re.search(r'name="page_ids" value="([\d,]+)"', discard_form).group(1)
    assert sorted(int(i) for i in value.split(",")) == dead
    post(admin, "/admin/deliveries/discard", {"page_ids": value, **CONFIRM})
    assert {state_of(admin_app, d)[0] for d in dead} == {"discarded"}
    assert "Discarded 3 deliveries" in text(admin.get("/admin/dead"))


def test_dead_letters_page_offers_discard_with_a_required_confirmation(admin_app, admin):
    delivery(admin_app, event(admin_app), state="dead")
    page = text(admin.get("/admin/dead"))
    fieldset = page[page.index('id="discard"') : page.index("</fieldset>")]
    assert re.search(r'<input type="checkbox" name="confirm" value="yes" required>', fieldset)
    assert "I understand these deliveries will never be retried" in fieldset
    assert fieldset.count('formaction="/admin/deliveries/discard"') == 2
    # The requeue buttons share the form; the confirmation must not hold them up.
    requeues = re.findall(r"<button[^>]*>Requeue[^<]*</button>", page)
    assert len(requeues) == 2 and all("formnovalidate" in b for b in requeues)


def test_discard_without_confirmation_changes_nothing(admin_app, admin):
    dead = delivery(admin_app, event(admin_app), state="dead", attempts=8)
    for unconfirmed in ({}, {"confirm": ""}, {"confirm": "no"}):
        response = post(admin, "/admin/deliveries/discard", {"ids": dead, **unconfirmed})
        assert response.status_code == 302
        assert state_of(admin_app, dead) == ("dead", 8)
        assert "Nothing was discarded" in text(admin.get("/admin/dead"))


def test_discard_refuses_junk_and_foreign_redirects(admin_app, admin):
    dead = delivery(admin_app, event(admin_app), state="dead")
    bad = {"ids": [dead, "1; drop"], **CONFIRM}
    assert post(admin, "/admin/deliveries/discard", bad).status_code == 400
    bad_page = {"page_ids": f"{dead},x", **CONFIRM}
    assert post(admin, "/admin/deliveries/discard", bad_page).status_code == 400
    assert state_of(admin_app, dead)[0] == "dead"
    response = post(
        admin, "/admin/deliveries/discard", {"next": "https://evil.example/", **CONFIRM}
    )
    assert response.headers["Location"] == "/admin/dead"
    assert "Nothing was selected." in text(admin.get("/admin/dead"))


def test_discard_logged_out_is_sent_to_login_and_changes_nothing(admin_app, anon):
    dead = delivery(admin_app, event(admin_app), state="dead")
    response = anon.get("/admin/dead")
    assert response.status_code == 302
    assert response.headers["Location"].startswith("/admin/login?next=")
    # A POST without a session is refused outright, as every admin action is.
    token = csrf_token(anon)  # a valid token of this (logged-out) session
    response = anon.post(
        "/admin/deliveries/discard", data={"ids": dead, "csrf_token": token, **CONFIRM}
    )
    assert response.status_code == 403
    assert state_of(admin_app, dead)[0] == "dead"


def test_a_discarded_delivery_cannot_be_requeued(admin_app, admin):
    event_id = event(admin_app)
    discarded = delivery(admin_app, event_id, state="discarded", attempts=8)
    post(admin, "/admin/deliveries/requeue", {"ids": discarded})
    assert state_of(admin_app, discarded) == ("discarded", 8)
    assert "Requeued 0 deliveries. 1 could not be requeued" in text(admin.get("/admin/dead"))


def test_event_page_shows_the_discarded_state(admin_app, admin):
    event_id = event(admin_app)
    dead = delivery(admin_app, event_id, consumer="gone", state="dead", last_error="HTTP 410")
    delivery(admin_app, event_id, consumer="fine", state="delivered")
    post(admin, "/admin/deliveries/discard", {"ids": dead, **CONFIRM})
    page = text(admin.get(f"/admin/events/{event_id}"))
    row = page[page.index(f'data-delivery-id="{dead}"') :].split("</tr>")[0]
    assert '<span class="state state-discarded">discarded</span>' in row
    assert "HTTP 410" in row and "Requeue" not in row
    assert listed_ids(admin.get("/admin/events?state=discarded")) == [event_id]
    assert listed_ids(admin.get("/admin/events?state=dead")) == []
    summary = text(admin.get("/admin/events"))
    assert 'state-discarded">discarded</span>' in summary


def test_discard_logs_one_line_and_counts_per_consumer(admin_app, admin, caplog):
    from prometheus_client.parser import text_string_to_metric_families

    first, second = event(admin_app, source="stripe"), event(admin_app, source="stripe")
    dead = [
        delivery(admin_app, first, consumer="gone", state="dead"),
        delivery(admin_app, second, consumer="gone", state="dead"),
        delivery(admin_app, second, consumer="crm", state="dead"),
    ]
    pending = delivery(admin_app, first, consumer="crm", state="pending")
    with caplog.at_level("INFO", logger="webhook_receiver.admin"):
        post(admin, "/admin/deliveries/discard", {"ids": [*dead, pending], **CONFIRM})
    lines = [r for r in caplog.records if getattr(r, "outcome", None) == "discarded"]
    assert len(lines) == 1
    line = lines[0]
    assert (line.count, line.not_discarded) == (3, 1)
    assert line.consumers == ["crm", "gone"]
    assert line.event_ids == [first, second]
    assert line.delivery_ids == dead
    scraped = admin_app.test_client().get("/metrics").get_data(as_text=True)
    counts = {
        (sample.labels["source"], sample.labels["consumer"]): sample.value
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
        if sample.name == "webhook_receiver_deliveries_discarded_total"
    }
    assert counts == {("stripe", "gone"): 2, ("stripe", "crm"): 1}


def listed_ids(response):
    return [int(i) for i in re.findall(r'data-event-id="(\d+)"', text(response))]


# -- conflicts ---------------------------------------------------------------


def test_conflict_shows_both_payloads_with_differences_marked(admin_app, admin):
    event_id = event(
        admin_app,
        body=b'{"id": "evt_1", "amount": 100, "currency": "eur", "a": 1, "b": 2, "c": 3, "d": 4}',
        headers=[["Content-Type", "application/json"], ["X-Request", "one"]],
    )
    conflict_id = conflict(
        admin_app,
        event_id,
        body=b'{"d": 4, "c": 3, "b": 2, "a": 1, "currency": "eur", "amount": 250, "id": "evt_1"}',
        headers=[["Content-Type", "application/json"], ["X-Request", "two"]],
        seen_count=3,
    )
    page = text(admin.get(f"/admin/conflicts/{conflict_id}"))
    body = page[page.index('id="body-diff"') : page.index("</table>", page.index('id="body-diff"'))]
    # Key order is no difference: only the amount line differs, highlighted on both sides.
    assert body.count('class="diff-replace"') == 1
    replaced = body[body.index('class="diff-replace"') :].split("</tr>")[0]
    assert '<td class="code old">' in replaced and '<td class="code new">' in replaced
    assert "<mark>100</mark>," in replaced and "<mark>250</mark>," in replaced
    assert "&#34;currency&#34;: &#34;eur&#34;" in body
    headers = page[page.index('id="header-diff"') :]
    assert "X-Request: <mark>one</mark>" in headers and "X-Request: <mark>two</mark>" in headers
    assert "seen 3×" in page
    assert f'href="/admin/events/{event_id}"' in page


def test_long_unchanged_runs_fold(admin_app, admin):
    lines = [f"line {i}" for i in range(40)]
    changed = lines[:20] + ["changed"] + lines[21:]
    event_id = event(admin_app, body="\n".join(lines).encode(), content_type="text/plain")
    conflict_id = conflict(
        admin_app, event_id, body="\n".join(changed).encode(), content_type="text/plain"
    )
    page = text(admin.get(f"/admin/conflicts/{conflict_id}"))
    assert "⋯ 17 unchanged lines" in page and "⋯ 16 unchanged lines" in page


def test_mark_reviewed_with_a_note(admin_app, admin):
    event_id = event(admin_app)
    conflict_id = conflict(admin_app, event_id)
    assert f'data-conflict-id="{conflict_id}"' in text(admin.get("/admin/conflicts"))
    response = post(
        admin, f"/admin/conflicts/{conflict_id}/review", {"note": "  Provider bug #12 "}
    )
    assert response.status_code == 302
    assert response.headers["Location"] == f"/admin/conflicts/{conflict_id}"
    with admin_app.app_context():
        row = db.session.get(EventConflict, conflict_id)
        assert row.review_note == "Provider bug #12"
        assert row.reviewed_at is not None
    page = text(admin.get(f"/admin/conflicts/{conflict_id}"))
    assert "Marked as reviewed." in page and "Provider bug #12" in page
    assert f'data-conflict-id="{conflict_id}"' not in text(admin.get("/admin/conflicts"))
    reviewed = text(admin.get("/admin/conflicts?view=reviewed"))
    assert f'data-conflict-id="{conflict_id}"' in reviewed and "Provider bug #12" in reviewed
    assert f'data-conflict-id="{conflict_id}"' in text(admin.get("/admin/conflicts?view=all"))


def _review_form(client, conflict_id: int) -> dict[str, str]:
    """The hidden fields of a conflict page's review form, as the browser would post them."""
    page = text(client.get(f"/admin/conflicts/{conflict_id}"))
    form = page[page.index('id="review"') :]
    return dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', form))


def test_two_operators_reviewing_at_once_do_not_overwrite_each_other(admin_app, admin):
    # Both opened the page before either saved: the second save replaced the
    # first operator's note without a word, and the page said "reviewed".
    other = admin_app.test_client()
    assert login(other).status_code == 302
    conflict_id = conflict(admin_app, event(admin_app))
    first, second = _review_form(admin, conflict_id), _review_form(other, conflict_id)
    url = f"/admin/conflicts/{conflict_id}/review"
    assert admin.post(url, data={**first, "note": "Refunded twice: fixed"}).status_code == 302
    response = other.post(url, data={**second, "note": "Nothing to do"})
    assert response.status_code == 409
    with admin_app.app_context():
        assert db.session.get(EventConflict, conflict_id).review_note == "Refunded twice: fixed"
    # The page shows the review saved meanwhile, and keeps the refused note to edit.
    page = text(response)
    assert "Your note was not saved" in page
    assert '<p class="note">Refunded twice: fixed</p>' in page
    assert ">Nothing to do</textarea>" in page
    # Having seen the other review, the second operator may update it.
    page = page[page.index('id="review"') :]
    again = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', page))
    assert other.post(url, data={**again, "note": "Nothing more to do"}).status_code == 302
    with admin_app.app_context():
        assert db.session.get(EventConflict, conflict_id).review_note == "Nothing more to do"


@pytest.mark.parametrize("reviewed", ["x", "-1", "1.5", "999999999999999999", "1" * 19])
def test_a_review_form_with_a_bad_version_is_a_400(admin_app, admin, reviewed):
    conflict_id = conflict(admin_app, event(admin_app))
    form = {"note": "x", "reviewed": reviewed}
    assert post(admin, f"/admin/conflicts/{conflict_id}/review", form).status_code == 400
    with admin_app.app_context():
        assert db.session.get(EventConflict, conflict_id).reviewed_at is None


def test_review_of_a_missing_conflict_or_an_overlong_note(admin_app, admin):
    assert post(admin, "/admin/conflicts/424242/review", {"note": "x"}).status_code == 404
    conflict_id = conflict(admin_app, event(admin_app))
    long_note = {"note": "x" * 2001}
    assert post(admin, f"/admin/conflicts/{conflict_id}/review", long_note).status_code == 400
    with admin_app.app_context():
        assert db.session.get(EventConflict, conflict_id).reviewed_at is None
    assert admin.get("/admin/conflicts/424242").status_code == 404


def test_conflicts_list_pages_by_keyset(make_app):
    from .conftest import PASSWORD, login

    app = make_app(ADMIN_PASSWORD=PASSWORD, ADMIN_PAGE_SIZE=2)
    client = app.test_client()
    login(client)
    event_id = event(app)
    now = utcnow()
    made = [conflict(app, event_id, received_at=now - timedelta(minutes=i)) for i in range(5)]
    seen = []
    url = "/admin/conflicts"
    while url:
        page = text(client.get(url))
        seen += [int(i) for i in re.findall(r'data-conflict-id="(\d+)"', page)]
        found = re.search(r'<a href="([^"]+)" rel="next">', page)
        url = found.group(1).replace("&amp;", "&") if found else None
    assert seen == made


# -- idempotency keys --------------------------------------------------------


def test_idempotency_keys_per_client_with_state_and_expiry(admin_app, admin):
    now = utcnow()
    done = idempotency_record(admin_app, client="acme", key="done", created_at=now)
    live = idempotency_record(
        admin_app,
        client="acme",
        key="live",
        state="in_progress",
        lease_expires_at=now + timedelta(minutes=1),
        created_at=now - timedelta(seconds=1),
    )
    abandoned = idempotency_record(
        admin_app,
        client="globex",
        key="abandoned",
        state="in_progress",
        lease_expires_at=now - timedelta(minutes=1),
        created_at=now - timedelta(minutes=2),
    )
    expired = idempotency_record(
        admin_app, client="globex", key="old", created_at=now - timedelta(days=2)
    )

    def rows(query=""):
        page = text(admin.get(f"/admin/idempotency{query}"))
        return [int(i) for i in re.findall(r'data-record-id="(\d+)"', page)], page

    ids, page = rows()
    assert ids == [done, live, abandoned, expired]
    for record_id, shown in [
        (done, "completed"),
        (live, "in progress"),
        (abandoned, "abandoned"),
        (expired, "expired"),
    ]:
        row = page[page.index(f'data-record-id="{record_id}"') :].split("</tr>")[0]
        assert f">{shown}</span>" in row, row
    assert (now + timedelta(hours=24)).strftime("%Y-%m-%d %H:%M:%S") in page
    assert '<option value="globex">' in page
    assert rows("?client=acme")[0] == [done, live]
    assert rows("?state=expired")[0] == [expired]
    assert rows("?state=in_progress")[0] == [live, abandoned]
    assert rows("?state=completed&client=globex")[0] == []
    assert rows("?key=live&client=acme")[0] == [live]


def test_evict_a_key(admin_app, admin):
    record_id = idempotency_record(admin_app, key="k-evict")
    keep = idempotency_record(admin_app, key="k-keep")
    response = post(
        admin,
        f"/admin/idempotency/{record_id}/evict",
        {"next": "/admin/idempotency?client=acme", **CONFIRM},
    )
    assert response.status_code == 302
    assert response.headers["Location"] == "/admin/idempotency?client=acme"
    with admin_app.app_context():
        assert db.session.get(IdempotencyRecord, record_id) is None
        assert db.session.get(IdempotencyRecord, keep) is not None
    assert "Evicted the key" in text(admin.get("/admin/idempotency"))
    post(admin, f"/admin/idempotency/{record_id}/evict", CONFIRM)
    assert "That key was already gone." in text(admin.get("/admin/idempotency"))


def test_an_eviction_posted_without_its_confirmation_evicts_nothing(admin_app, admin):
    # The form's tick is required in the browser; a form posted by hand (or
    # with JavaScript's checks bypassed) must not evict either: its next
    # request would run a completed request a second time.
    record_id = idempotency_record(admin_app, key="k-unconfirmed")
    for form in ({}, {"confirm": "no"}):
        response = post(admin, f"/admin/idempotency/{record_id}/evict", form)
        assert response.status_code == 302
        assert "Nothing was evicted" in text(admin.get("/admin/idempotency"))
    with admin_app.app_context():
        assert db.session.get(IdempotencyRecord, record_id) is not None


def test_a_key_whose_request_is_running_is_not_evicted(admin_app, admin):
    # Evicting it let the client's retry run the request a second time while
    # the first still ran: an API event is stored under a fresh key each
    # time, so both were stored and delivered.
    now, minute = utcnow(), timedelta(minutes=1)
    running = idempotency_record(
        admin_app, key="k-running", state="in_progress", lease_expires_at=now + minute
    )
    abandoned = idempotency_record(
        admin_app, key="k-abandoned", state="in_progress", lease_expires_at=now - minute
    )
    page = text(admin.get("/admin/idempotency"))
    assert f"/admin/idempotency/{running}/evict" not in page
    assert f"/admin/idempotency/{abandoned}/evict" in page
    response = post(admin, f"/admin/idempotency/{running}/evict", CONFIRM)
    assert response.status_code == 302
    assert "still running" in text(admin.get("/admin/idempotency"))
    post(admin, f"/admin/idempotency/{abandoned}/evict", CONFIRM)
    with admin_app.app_context():
        assert db.session.get(IdempotencyRecord, running) is not None
        assert db.session.get(IdempotencyRecord, abandoned) is None


def test_an_evicted_key_runs_afresh_on_the_api(admin_app, admin):
    from ..conftest import bearer

    api = admin_app.test_client()
    body = {"type": "order.created", "data": {"n": 1}}
    headers = {**bearer(), "Idempotency-Key": "evict-me"}
    first = api.post("/api/events", json=body, headers=headers)
    assert first.status_code == 201
    with admin_app.app_context():
        record_id = db.session.query(IdempotencyRecord.id).scalar()
    post(admin, f"/admin/idempotency/{record_id}/evict", CONFIRM)
    again = api.post("/api/events", json=body, headers=headers)
    assert again.status_code == 201
    assert "Idempotent-Replayed" not in again.headers
    assert again.get_json()["id"] != first.get_json()["id"]


# -- rejections --------------------------------------------------------------


@pytest.mark.parametrize("query", ["", "?source=github"])
def test_rejections_list(admin_app, admin, query):
    rejection(admin_app, source="stripe", detail="no signature matched", remote_addr="203.0.113.9")
    rejection(admin_app, source="github", reason="timestamp", detail="too old")
    page = text(admin.get(f"/admin/rejections{query}"))
    assert "too old" in page
    assert ("no signature matched" in page) is (query == "")


# -- the conflict diff is bounded ------------------------------------------------


def _items(n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    items = [{"id": i, "v": rng.random(), "name": "x" * rng.randint(1, 30)} for i in range(n)]
    return json.dumps({"id": "evt_big", "items": items}).encode()


def test_a_conflict_past_the_diff_bounds_shows_both_bodies_plainly(admin_app, admin) -> None:
    original = _items(1500, 1)  # about 100 KB, every line different
    event_id = event(admin_app, body=original)
    conflict_id = conflict(admin_app, event_id, body=_items(1500, 2))
    response = admin.get(f"/admin/conflicts/{conflict_id}")
    assert response.status_code == 200
    page = response.get_data(as_text=True)
    assert 'id="body-too-large"' in page and 'id="body-plain"' in page
    assert 'id="body-diff"' not in page
    # Both bodies are there in full (pretty-printed), the last item included.
    assert page.count("&#34;id&#34;: 1499") == 2
    # Small headers are still compared.
    assert 'id="header-diff"' in page


def test_a_small_conflict_is_still_highlighted(admin_app, admin) -> None:
    event_id = event(admin_app, body=b'{"id":"evt_1","amount":100}')
    conflict_id = conflict(admin_app, event_id, body=b'{"id":"evt_1","amount":250}')
    page = admin.get(f"/admin/conflicts/{conflict_id}").get_data(as_text=True)
    assert 'id="body-diff"' in page and "too-large" not in page
    assert "<mark>250</mark>" in page


def test_an_event_with_thousands_of_conflicts_lists_the_newest_and_counts_them(
    admin_app, admin
) -> None:
    # A sender that reuses one dedup key for everything: the event page
    # listed every conflict (3,000 made a 418 KB page).
    from webhook_receiver.admin.queries import CONFLICTS_SHOWN

    event_id = event(admin_app, dedup_key="always-1")
    total = CONFLICTS_SHOWN + 5
    with admin_app.app_context():
        original = db.session.get(Event, event_id)
        db.session.add_all(
            EventConflict(
                event_id=event_id,
                source=original.source,
                dedup_key=original.dedup_key,
                fingerprint=f"{n:064x}",
                content_type="application/json",
                body=b"{}",
                headers=[],
                received_at=NOW + timedelta(seconds=n),
                last_seen_at=NOW + timedelta(seconds=n),
            )
            for n in range(total)
        )
        db.session.commit()
        newest = db.session.query(func.max(EventConflict.id)).scalar()
    page = text(admin.get(f"/admin/events/{event_id}"))
    assert page.count('href="/admin/conflicts/') == CONFLICTS_SHOWN
    assert f'href="/admin/conflicts/{newest}"' in page
    assert f"The newest {CONFLICTS_SHOWN} are shown" in page
    assert f'Conflicting deliveries <small class="muted">{total}</small>' in page


def test_an_event_past_the_attempts_shown_says_only_the_newest_are_listed(
    admin_app, admin, monkeypatch
) -> None:
    # The event page lists the newest attempts of all its deliveries; past
    # that it cut the oldest without a word.
    from webhook_receiver.admin import delivery_queries
    from webhook_receiver.models import DeliveryAttempt

    monkeypatch.setattr(delivery_queries, "ATTEMPTS_SHOWN", 5)
    event_id = event(admin_app)
    delivery_id = delivery(admin_app, event_id, state="dead", attempts=6)

    def attempts(count: int) -> None:
        with admin_app.app_context():
            db.session.add_all(
                DeliveryAttempt(
                    delivery_id=delivery_id,
                    number=n,
                    started_at=NOW,
                    ended_at=NOW,
                    outcome="retry",
                    latency_ms=1.0,
                    status=503,
                )
                for n in range(1, count + 1)
            )
            db.session.commit()

    attempts(4)
    page = text(admin.get(f"/admin/events/{event_id}"))
    assert page.count("data-attempt=") == 4 and 'id="attempts-cut"' not in page
    attempts(2)
    page = text(admin.get(f"/admin/events/{event_id}"))
    assert page.count("data-attempt=") == 5
    assert "Only the newest 5 attempts of this event" in page
