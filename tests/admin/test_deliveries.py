"""The Deliveries page, the event page's attempts and replay, bulk replays and their record."""

from __future__ import annotations

import html
import re
import threading
from datetime import timedelta

from sqlalchemy import select

from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery, DeliveryAttempt, Replay
from webhook_receiver.processing import replay

from .conftest import NOW, add, delivery, event, post, text


def attempt(app, delivery_id: int, number: int, outcome: str, **kwargs) -> int:
    return add(
        app,
        DeliveryAttempt(
            delivery_id=delivery_id,
            number=number,
            started_at=kwargs.pop("started_at", NOW + timedelta(seconds=number)),
            ended_at=kwargs.pop("ended_at", NOW + timedelta(seconds=number, milliseconds=12)),
            outcome=outcome,
            latency_ms=kwargs.pop("latency_ms", 12.5),
            **kwargs,
        ),
    )


def shown_ids(page: str, marker: str = "data-delivery-id") -> list[int]:
    return [int(n) for n in re.findall(rf'{marker}="(\d+)"', page)]


def deliveries_of(app) -> dict[int, tuple[str, int, int]]:
    with app.app_context():
        rows = db.session.execute(
            select(Delivery.id, Delivery.state, Delivery.attempts, Delivery.key_replay).order_by(
                Delivery.id
            )
        ).all()
        db.session.rollback()
    return {row.id: (row.state, row.attempts, row.key_replay) for row in rows}


def replay_records(app) -> list[Replay]:
    with app.app_context():
        found = list(db.session.scalars(select(Replay).order_by(Replay.id)))
        db.session.expunge_all()
        db.session.rollback()
    return found


def test_the_deliveries_page_filters_and_pages(admin_app, admin):
    old = event(
        admin_app, source="stripe", event_type="invoice.paid", received_at=NOW - timedelta(days=2)
    )
    new = event(admin_app, source="github", event_type="push", received_at=NOW)
    ids = {
        "old-billing": delivery(admin_app, old, consumer="billing", state="delivered"),
        "old-audit": delivery(
            admin_app, old, consumer="audit", state="dead", last_error="HTTP 500"
        ),
        "new-billing": delivery(admin_app, new, consumer="billing", state="pending"),
        "new-ci": delivery(admin_app, new, consumer="ci", state="delivered"),
    }
    page = text(admin.get("/admin/deliveries"))
    # Newest event first, then by delivery id, newest first.
    assert shown_ids(page) == [
        ids["new-ci"],
        ids["new-billing"],
        ids["old-audit"],
        ids["old-billing"],
    ]
    assert 'aria-current="page">Deliveries<' in page

    def found(**args) -> list[int]:
        response = admin.get("/admin/deliveries", query_string=args)
        assert response.status_code == 200
        return shown_ids(text(response))

    assert found(consumer="billing") == [ids["new-billing"], ids["old-billing"]]
    assert found(state="delivered") == [ids["new-ci"], ids["old-billing"]]
    assert found(source="stripe") == [ids["old-audit"], ids["old-billing"]]
    assert found(type="push", state="delivered") == [ids["new-ci"]]
    since = (NOW - timedelta(days=1)).strftime("%Y-%m-%d %H:%M")
    assert found(since=since) == [ids["new-ci"], ids["new-billing"]]
    assert found(until=since) == [ids["old-audit"], ids["old-billing"]]
    assert found(consumer="ci", state="dead") == []
    # A consumer no delivery has is a typo, said so (400), not an empty list.
    assert admin.get("/admin/deliveries?consumer=nobody").status_code == 400

    # Keyset paging, two to a page, keeping the filters.
    admin_app.config["ADMIN_PAGE_SIZE"] = 2
    first = text(admin.get("/admin/deliveries"))
    assert shown_ids(first) == [ids["new-ci"], ids["new-billing"]]
    older = re.search(r'href="([^"]+)" rel="next"', first).group(1).replace("&amp;", "&")
    second = text(admin.get(older))
    assert shown_ids(second) == [ids["old-audit"], ids["old-billing"]]
    assert 'rel="next"' not in second
    newer = re.search(r'href="([^"]+)" rel="prev"', second).group(1).replace("&amp;", "&")
    assert shown_ids(text(admin.get(newer))) == [ids["new-ci"], ids["new-billing"]]


def test_bad_filters_say_what_is_wrong(admin):
    response = admin.get("/admin/deliveries?state=lost&since=yesterday&limit=0")
    assert response.status_code == 400
    page = text(response)
    assert "Unknown state “lost”: choose one of" in page
    assert "“yesterday” is not a date and time" in page
    assert "The limit must be a number from 1 to 100,000." in page
    assert "No deliveries" in page
    response = admin.get("/admin/deliveries?before=not-a-cursor")
    assert response.status_code == 400


def test_the_pages_need_a_login_and_forms_a_csrf_token(admin_app, anon):
    evt = event(admin_app)
    delivery(admin_app, evt, state="delivered")
    for path in ("/admin/deliveries", "/admin/deliveries/replay", "/admin/replays"):
        response = anon.get(path)
        assert response.status_code == 302 and "/admin/login" in response.headers["Location"]
    assert anon.post(f"/admin/events/{evt}/replay").status_code == 400  # no CSRF token
    assert anon.post("/admin/deliveries/replay", data={"confirm": "yes"}).status_code == 400
    assert deliveries_of(admin_app)[1][0] == "delivered"
    assert replay_records(admin_app) == []


def test_the_event_page_shows_each_deliverys_attempts(admin_app, admin):
    evt = event(admin_app)
    billing = delivery(admin_app, evt, consumer="billing", state="delivered", attempts=3)
    audit = delivery(admin_app, evt, consumer="audit", state="pending")
    attempt(admin_app, billing, 1, "retryable_failure", status=500, error="HTTP 500: <b>boom</b>")
    attempt(
        admin_app,
        billing,
        2,
        "retryable_failure",
        status=503,
        error="HTTP 503",
        response_body="<script>alert(1)</script>",
    )
    attempt(admin_app, billing, 3, "delivered", status=200, response_body='{"ok": true}')
    page = text(admin.get(f"/admin/events/{evt}"))
    panel = page.split(f'data-attempts-of="{billing}"', 1)[1].split("</table>", 1)[0]
    assert re.findall(r'data-attempt="(\d+)"', panel) == ["1", "2", "3"]
    outcomes = re.findall(r'class="attempt-outcome"><span class="state state-(\w+)"', panel)
    assert outcomes == ["retryable_failure", "retryable_failure", "delivered"]
    assert re.findall(r'class="attempt-status">(\d+)<', panel) == ["500", "503", "200"]
    assert "12.5 ms" in panel
    # Everything the downstream said is shown as text.
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in panel
    assert "HTTP 500: &lt;b&gt;boom&lt;/b&gt;" in panel
    assert f'data-attempts-of="{audit}"' not in page  # not attempted yet
    assert f'action="/admin/events/{evt}/replay"' in page


def test_an_event_is_replayed_from_its_page(admin_app, admin):
    evt = event(admin_app)
    billing = delivery(admin_app, evt, consumer="billing", state="delivered", attempts=1)
    audit = delivery(admin_app, evt, consumer="audit", state="dead", attempts=8)
    response = post(admin, f"/admin/events/{evt}/replay", {"consumer": "billing"})
    assert response.status_code == 302
    assert response.headers["Location"].endswith(f"/admin/events/{evt}#deliveries")
    page = text(admin.get(f"/admin/events/{evt}"))
    assert "queued 1 delivery again (the Idempotency-Key (message id) is kept" in page
    assert deliveries_of(admin_app)[billing] == ("pending", 0, 0)
    assert deliveries_of(admin_app)[audit] == ("dead", 8, 0)

    post(admin, f"/admin/events/{evt}/replay", {"consumer": "", "new_key": "yes"})
    assert "queued 2 deliveries again, each with a new key." in text(
        admin.get(f"/admin/events/{evt}")
    )
    assert deliveries_of(admin_app)[billing] == ("pending", 0, 1)
    assert deliveries_of(admin_app)[audit] == ("pending", 0, 1)

    records = replay_records(admin_app)
    assert [(r.via, r.new_key, r.matched, r.replayed, r.filters) for r in records] == [
        ("admin", False, 1, 1, {"event_id": evt, "consumer": "billing"}),
        ("admin", True, 2, 2, {"event_id": evt}),
    ]
    assert records[0].actor == "admin from 127.0.0.1"

    response = post(admin, f"/admin/events/{evt}/replay", {"consumer": "nobody"})
    assert response.status_code == 302
    refused = f"Nothing was replayed: event {evt} has no delivery to consumer &#39;nobody&#39;"
    assert refused in text(admin.get(f"/admin/events/{evt}"))
    assert post(admin, "/admin/events/999999/replay", {}).status_code == 404
    assert len(replay_records(admin_app)) == 2


def test_a_replay_to_a_consumer_named_like_the_missing_event_error_is_no_404(admin_app, admin):
    # The view told a missing event by "no event" in the error's text, which
    # also quotes the consumer asked for: an existing event answered 404.
    evt = event(admin_app)
    delivery(admin_app, evt, consumer="billing", state="dead")
    response = post(admin, f"/admin/events/{evt}/replay", {"consumer": "no events"})
    assert response.status_code == 302
    page = text(admin.get(f"/admin/events/{evt}"))
    assert "has no delivery to consumer &#39;no events&#39;" in page


def test_a_time_filter_before_the_year_1000_survives_the_confirmation(admin_app, admin):
    # Times were written back with strftime's %Y, unpadded before the year
    # 1000 ("1-01-01 00:00"): the confirmation form's own since was refused.
    delivery(admin_app, event(admin_app), consumer="billing", state="dead")
    page = text(admin.get("/admin/deliveries?since=0001-01-01"))
    assert 'name="since" value="0001-01-01 00:00"' in page
    page = text(admin.get("/admin/deliveries/replay?since=0001-01-01"))
    assert "from 0001-01-01 00:00:00 UTC" in page
    form = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', page))
    assert form["since"] == "0001-01-01 00:00"
    data = {k: v for k, v in form.items() if k != "csrf_token"}
    response = post(admin, "/admin/deliveries/replay", {**data, "confirm": "yes"})
    assert response.status_code == 302 and response.headers["Location"].endswith("/admin/replays")
    assert len(replay_records(admin_app)) == 1


def test_a_bulk_replay_shows_the_count_then_replays_that_many(admin_app, admin):
    ids = []
    for _ in range(5):
        evt = event(admin_app, source="stripe")
        ids.append(delivery(admin_app, evt, consumer="billing", state="delivered", attempts=1))
        delivery(admin_app, evt, consumer="audit", state="delivered", attempts=1)
    dead = delivery(admin_app, event(admin_app, source="stripe"), consumer="billing", state="dead")

    filters = {"consumer": "billing", "state": "delivered", "source": "stripe", "limit": "4"}
    page = text(admin.get("/admin/deliveries/replay", query_string=filters))
    assert re.search(r'id="replay-count"><strong>4</strong> deliveries match', page)
    form = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', page))
    assert form["count"] == "4" and form["up_to"] == str(ids[3])
    assert {k: form[k] for k in filters} == filters
    assert replay_records(admin_app) == []  # counting changes nothing

    # Not confirmed: nothing happens.
    data = {k: v for k, v in form.items() if k != "csrf_token"}
    response = post(admin, "/admin/deliveries/replay", data)
    assert response.status_code == 302
    assert all(deliveries_of(admin_app)[i][0] == "delivered" for i in ids)

    response = post(admin, "/admin/deliveries/replay", {**data, "confirm": "yes", "new_key": "yes"})
    assert response.status_code == 302 and response.headers["Location"].endswith("/admin/replays")
    listing = text(admin.get("/admin/replays"))
    assert "Replay 1: 4 deliveries to queue again, each with a new key." in listing
    assert "A worker queues them in batches, in the background" in listing
    assert "waiting for a worker" in listing
    # Recorded, not run yet: a worker runs it.
    [record] = replay_records(admin_app)
    assert (record.matched, record.replayed, record.finished_at) == (4, 0, None)
    assert all(deliveries_of(admin_app)[i][0] == "delivered" for i in ids)

    with admin_app.app_context():
        assert replay.Runner(admin_app, threading.Event(), 1.0).run_once()
    states = deliveries_of(admin_app)
    assert [states[i] for i in ids] == [("pending", 0, 1)] * 4 + [("delivered", 1, 0)]
    assert states[dead][0] == "dead"
    [record] = replay_records(admin_app)
    assert (record.matched, record.replayed, record.new_key, record.via) == (4, 4, True, "admin")
    assert record.finished_at is not None and record.lease_token is None
    assert record.filters == {
        "consumer": "billing",
        "state": "delivered",
        "source": "stripe",
        "limit": 4,
    }
    listing = text(admin.get("/admin/replays"))
    assert shown_ids(listing, "data-replay-id") == [record.id]
    assert "consumer=billing, source=stripe, state=delivered, limit=4" in listing
    assert "waiting for a worker" not in listing


def test_a_bulk_replay_from_a_time_with_seconds_replays_what_was_counted(admin_app, admin):
    # The confirmation carried the times cut to the minute: from 08:00:30
    # became from 08:00, and with a limit the count still matched, so the
    # replay took an older delivery than the one counted and shown.
    minute = (NOW - timedelta(days=1)).replace(second=0)
    early = delivery(
        admin_app, event(admin_app, received_at=minute + timedelta(seconds=10)), state="dead"
    )
    late = delivery(
        admin_app, event(admin_app, received_at=minute + timedelta(seconds=40)), state="dead"
    )
    since = (minute + timedelta(seconds=30)).strftime("%Y-%m-%d %H:%M:%S")
    page = text(admin.get("/admin/deliveries/replay", query_string={"since": since, "limit": "1"}))
    form = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', page))
    assert form["count"] == "1" and form["up_to"] == str(late)
    data = {k: v for k, v in form.items() if k != "csrf_token"}
    response = post(admin, "/admin/deliveries/replay", {**data, "confirm": "yes"})
    assert response.status_code == 302
    with admin_app.app_context():
        assert replay.Runner(admin_app, threading.Event(), 1.0).run_once()
    states = deliveries_of(admin_app)
    assert (states[late][0], states[early][0]) == ("pending", "dead")
    assert form["since"] == since
    # The filter form shows the time as typed too, in a form its own pattern accepts.
    for typed in (since, since + ".5"):
        page = text(admin.get("/admin/deliveries", query_string={"since": typed}))
        shown = re.search(r'name="since" value="([^"]*)"[^>]*pattern="([^"]*)"', page)
        assert shown.group(1) == (typed if typed == since else since + ".500000")
        assert re.fullmatch(html.unescape(shown.group(2)), shown.group(1))


def test_a_bulk_replay_whose_count_changed_asks_again(admin_app, admin):
    for _ in range(3):
        delivery(admin_app, event(admin_app), consumer="billing", state="dead")
    page = text(admin.get("/admin/deliveries/replay?state=dead"))
    form = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', page))
    assert form["count"] == "3"
    # A worker (or another operator) moves one out of the filter meanwhile.
    with admin_app.app_context():
        db.session.execute(
            Delivery.__table__.update().where(Delivery.id == 1).values(state="pending")
        )
        db.session.commit()
    data = {k: v for k, v in form.items() if k != "csrf_token"}
    response = post(admin, "/admin/deliveries/replay", {**data, "confirm": "yes"})
    assert response.status_code == 200
    page = text(response)
    assert "Nothing was replayed: 2 deliveries match now, not the 3 shown." in page
    assert re.search(r'id="replay-count"><strong>2</strong> deliveries match', page)
    assert replay_records(admin_app) == []
    assert [s for s, _, _ in deliveries_of(admin_app).values()] == ["pending", "dead", "dead"]


def test_a_tampered_confirmation_is_refused(admin_app, admin):
    delivery(admin_app, event(admin_app), state="dead")
    for data in (
        {"confirm": "yes"},
        {"confirm": "yes", "count": "1", "up_to": "x"},
        {"confirm": "yes", "count": "1", "up_to": "1", "state": "lost"},
        {"confirm": "yes", "count": "1", "up_to": "1", "limit": "1000001"},
    ):
        assert post(admin, "/admin/deliveries/replay", data).status_code == 400
    assert replay_records(admin_app) == []


def test_nothing_to_replay_offers_no_button(admin):
    page = text(admin.get("/admin/deliveries/replay?state=dead"))
    assert "<strong>0</strong> deliveries match: nothing to replay." in page
    assert 'name="confirm"' not in page
