"""The event list (keyset paging, filters, search) and the event page."""

from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from sqlalchemy import event as sa_event

from webhook_receiver.extensions import db
from webhook_receiver.models import Event, utcnow

from .conftest import PASSWORD, conflict, delivery, duplicate, event, login, text

_ROW = re.compile(r'data-event-id="(\d+)"')
_LINK = re.compile(r'<a href="([^"]+)" rel="(next|prev)">')
_OWN_DUPLICATES = re.compile(
    r"\(SELECT COUNT\(\*\) AS \w+\s+FROM EVENT_DUPLICATES\s+"
    r"WHERE EVENT_DUPLICATES\.EVENT_ID = EVENTS\.ID\)"
)


def listed(response) -> list[int]:
    assert response.status_code == 200, text(response)
    return [int(i) for i in _ROW.findall(text(response))]


def link(response, rel: str) -> str | None:
    for href, found in _LINK.findall(text(response)):
        if found == rel:
            return html.unescape(href)
    return None


@pytest.fixture
def paged_app(make_app):
    return make_app(ADMIN_PASSWORD=PASSWORD, ADMIN_PAGE_SIZE=3)


@pytest.fixture
def paged(paged_app):
    client = paged_app.test_client()
    assert login(client).status_code == 302
    return client


def test_keyset_pages_cover_every_event_once_in_order(paged_app, paged):
    base = utcnow().replace(microsecond=0)
    made = []
    # Ties on received_at are broken by id; microseconds must survive the cursor.
    for i, offset in enumerate([0, 0, 0, 1, 2, 2, 3, 5, 8, 13]):
        at = base - timedelta(minutes=offset, microseconds=i % 2 * 7)
        made.append((at, event(paged_app, received_at=at)))
    expected = [ident for _, ident in sorted(made, key=lambda m: (m[0], m[1]), reverse=True)]

    pages = []
    response = paged.get("/admin/events")
    assert link(response, "prev") is None
    while True:
        pages.append(listed(response))
        older = link(response, "next")
        if older is None:
            break
        response = paged.get(older)
    assert [len(p) for p in pages] == [3, 3, 3, 1]
    assert [i for page in pages for i in page] == expected

    # And back again with the "newer" links, page for page.
    back = [pages[-1]]
    while (newer := link(response, "prev")) is not None:
        response = paged.get(newer)
        back.append(listed(response))
    assert back[::-1] == pages


def test_list_page_uses_neither_offset_nor_a_full_count(admin_app, admin):
    for _ in range(3):
        event(admin_app)
    statements = []
    with admin_app.app_context():
        engine = db.engine

        def record(conn, cursor, statement, parameters, *args):
            statements.append((statement.upper(), parameters))

        sa_event.listen(engine, "before_cursor_execute", record)
        try:
            assert len(listed(admin.get("/admin/events?state=dead&source=stripe"))) == 0
            assert len(listed(admin.get("/admin/events"))) == 3
        finally:
            sa_event.remove(engine, "before_cursor_execute", record)
    on_events = [(s, p) for s, p in statements if "FROM EVENTS" in s]
    assert on_events
    for statement, parameters in on_events:
        assert "LIMIT" in statement
        # Each listed row counts its own duplicates (as many rows as the
        # LIMIT); nothing counts the events.
        assert "COUNT(" not in _OWN_DUPLICATES.sub("", statement)
        if "OFFSET" in statement:
            # SQLAlchemy's SQLite dialect always writes OFFSET, with 0.
            assert statement.rstrip().endswith("OFFSET ?") and parameters[-1] == 0


def test_invalid_cursor_is_a_400(admin):
    assert admin.get("/admin/events?before=nonsense").status_code == 400
    assert admin.get("/admin/events?after=1.x").status_code == 400
    assert admin.get("/admin/events?before=99999999999999999999999.1").status_code == 400


LISTS = [
    "/admin/events",
    "/admin/deliveries",
    "/admin/dead",
    "/admin/conflicts",
    "/admin/idempotency",
    "/admin/rejections",
    "/admin/replays",
]


@pytest.mark.parametrize("url", LISTS)
@pytest.mark.parametrize("extra", ["endpoint=x", "_method=POST", "_external=1", "_anchor=x"])
def test_a_query_argument_named_like_url_fors_own_is_not_a_500(admin, url, extra):
    # The pager's links keep the query's arguments: one named like an
    # argument of url_for itself (endpoint, _method, ...) was a 500 (a
    # TypeError, a BuildError), or turned the links absolute. It is left out.
    response = admin.get(f"{url}?before=1.1&{extra}")
    assert response.status_code == 200
    links = re.findall(r'<nav class="pager".*?</nav>', text(response), re.S)[0]
    # The newer link takes the cursor's own row in (after one id below it).
    assert f'href="{url}"' in links and f'href="{url}?after=1.0"' in links


def test_columns_of_the_list(admin_app, admin):
    event_id = event(admin_app, source="github", event_type="push", dedup_key="gh-delivery-1")
    for _ in range(4):
        duplicate(admin_app, event_id)
    delivery(admin_app, event_id, consumer="a", state="dead")
    delivery(admin_app, event_id, consumer="b", state="delivered")
    delivery(admin_app, event_id, consumer="c", state="delivered")
    page = text(admin.get("/admin/events"))
    row = page[page.index(f'data-event-id="{event_id}"') :].split("</tr>")[0]
    assert "github" in row and "push" in row and "gh-delivery-1" in row
    assert '<td class="num">4</td>' in row
    assert "state-dead" in row and "delivered ×2" in row


@pytest.fixture
def mixed(admin_app):
    now = utcnow()
    ids = {
        "paid": event(admin_app, source="stripe", event_type="invoice.paid", dedup_key="evt_A"),
        "push": event(admin_app, source="github", event_type="push", dedup_key="gh-1"),
        "old": event(
            admin_app,
            source="stripe",
            event_type="charge.failed",
            dedup_key="evt_OLD",
            received_at=now - timedelta(days=8),
        ),
        "dup": event(admin_app, source="github", event_type="push"),
        "conflicted": event(admin_app, source="shopify", event_type="orders/create"),
        "bare": event(admin_app, source="api:acme", event_type="order.created"),
    }
    delivery(admin_app, ids["paid"], state="dead", attempts=8, last_error="HTTP 500")
    delivery(admin_app, ids["paid"], consumer="audit", state="delivered")
    delivery(admin_app, ids["push"], state="pending", attempts=2, last_error="timeout")
    delivery(admin_app, ids["old"], state="delivered")
    duplicate(admin_app, ids["dup"])
    duplicate(admin_app, ids["dup"])
    delivery(admin_app, ids["dup"], state="delivered")
    delivery(admin_app, ids["dup"], consumer="audit", state="skipped")
    delivery(admin_app, ids["conflicted"], state="pending")
    conflict(admin_app, ids["conflicted"])
    return ids


@pytest.mark.parametrize(
    ("query", "names"),
    [
        ("", ["bare", "conflicted", "dup", "push", "paid", "old"]),
        ("source=stripe", ["paid", "old"]),
        ("type=push", ["dup", "push"]),
        ("source=github&type=push", ["dup", "push"]),
        ("state=dead", ["paid"]),
        ("state=pending", ["conflicted", "push"]),
        ("state=retrying", ["push"]),
        ("state=delivered", ["dup", "old"]),
        ("state=none", ["bare"]),
        ("state=duplicated", ["dup"]),
        ("state=conflicted", ["conflicted"]),
        ("q=evt_A", ["paid"]),
        ("q=evt_OLD&source=stripe", ["old"]),
        ("q=no-such-key", []),
        ("source=api:globex", []),
    ],
)
def test_filters(admin, mixed, query, names):
    assert listed(admin.get(f"/admin/events?{query}")) == [mixed[n] for n in names]


def test_a_source_nothing_has_is_said_so(admin, mixed):
    # Not an empty list an operator who mistyped would believe (400).
    response = admin.get("/admin/events?source=nowhere")
    assert response.status_code == 400
    assert "Unknown source “nowhere”" in text(response)


def test_search_by_event_id(admin, mixed):
    assert listed(admin.get(f"/admin/events?q={mixed['push']}")) == [mixed["push"]]


def test_time_range(admin, admin_app, mixed):
    now = utcnow()
    since = (now - timedelta(days=9)).strftime("%Y-%m-%dT%H:%M")
    until = (now - timedelta(days=7)).strftime("%Y-%m-%dT%H:%M")
    assert listed(admin.get(f"/admin/events?since={since}&until={until}")) == [mixed["old"]]
    recent = (now - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    assert mixed["old"] not in listed(admin.get(f"/admin/events?since={recent}"))
    page = admin.get(f"/admin/events?since={since}")
    # Shown back as ISO 8601 in UTC, whatever the browser's locale.
    assert f'value="{since.replace("T", " ")}"' in text(page)


def test_a_bad_date_says_so(admin, mixed):
    response = admin.get("/admin/events?since=yesterday")
    assert response.status_code == 400
    assert "is not a date and time" in text(response)
    assert _ROW.findall(text(response)) == []


def test_filters_survive_paging(paged_app, paged):
    for _ in range(4):
        event(paged_app, source="stripe")
    event(paged_app, source="github")
    first = paged.get("/admin/events?source=stripe")
    older = link(first, "next")
    assert "source=stripe" in older
    assert len(listed(paged.get(older))) == 1


def test_event_page_shows_everything(admin_app, admin):
    received = utcnow() - timedelta(hours=2)
    event_id = event(
        admin_app,
        body=b'{"id":"evt_1","data":{"object":{"amount":100}}}',
        headers=[
            ["Content-Type", "application/json"],
            ["Stripe-Signature", "t=1,v1=abc"],
            ["Authorization", "[redacted]"],
            ["X-Gitlab-Token", "the-shared-secret"],
        ],
        received_at=received,
        correlation_id="corr-123",
        meta={"provider_event_id": "evt_1"},
    )
    duplicate(admin_app, event_id, received + timedelta(minutes=1))
    duplicate(admin_app, event_id, received + timedelta(minutes=5))
    dead_id = delivery(
        admin_app,
        event_id,
        consumer="crm",
        state="dead",
        attempts=8,
        last_error="HTTP 503 from downstream",
        response_status=503,
    )
    done_id = delivery(admin_app, event_id, consumer="audit", state="delivered", attempts=1)
    conflict_id = conflict(admin_app, event_id)
    page = text(admin.get(f"/admin/events/{event_id}"))
    # Pretty JSON, indented.
    assert "  &#34;data&#34;: {\n    &#34;object&#34;" in page
    # Signatures are hidden like credentials, even in rows stored before redaction by name.
    assert "t=1,v1=abc" not in page
    assert "the-shared-secret" not in page
    assert page.count("[redacted]") == 3
    assert "corr-123" in page
    assert "HTTP 503 from downstream" in page and "503" in page
    assert (received + timedelta(minutes=5)).strftime("%Y-%m-%d %H:%M:%S") in page
    assert f"/admin/conflicts/{conflict_id}" in page
    dead_row = page[page.index(f'data-delivery-id="{dead_id}"') :].split("</tr>")[0]
    done_row = page[page.index(f'data-delivery-id="{done_id}"') :].split("</tr>")[0]
    assert "Requeue" in dead_row and "8" in dead_row
    assert "Requeue" not in done_row


def test_event_page_shows_the_fingerprint(admin_app, admin):
    event_id = event(admin_app)
    with admin_app.app_context():
        fingerprint = db.session.get(Event, event_id).fingerprint
    assert fingerprint in text(admin.get(f"/admin/events/{event_id}"))


def test_requeue_offered_for_failed_and_stuck_only(admin_app, admin):
    event_id = event(admin_app)
    now = utcnow()
    offered = {
        delivery(admin_app, event_id, consumer="dead", state="dead"): True,
        delivery(admin_app, event_id, consumer="failed", attempts=1, last_error="x"): True,
        delivery(admin_app, event_id, consumer="fresh"): False,
        delivery(
            admin_app,
            event_id,
            consumer="stuck",
            state="in_progress",
            lease_expires_at=now - timedelta(minutes=1),
        ): True,
        delivery(
            admin_app,
            event_id,
            consumer="working",
            state="in_progress",
            lease_expires_at=now + timedelta(minutes=5),
        ): False,
        delivery(admin_app, event_id, consumer="skipped", state="skipped"): False,
    }
    page = text(admin.get(f"/admin/events/{event_id}"))
    for delivery_id, expected in offered.items():
        row = page[page.index(f'data-delivery-id="{delivery_id}"') :].split("</tr>")[0]
        assert ("Requeue" in row) is expected, row


@pytest.mark.parametrize(
    ("body", "content_type", "expected", "kind"),
    [
        (b"plain text\nsecond line", "text/plain", "plain text\nsecond line", "text"),
        (b"a=1&b=<2>", "application/x-www-form-urlencoded", "a=1&amp;b=&lt;2&gt;", "text"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "image/png", "89 50 4e 47 0d 0a 1a 0a 00 00", "binary"),
        (b'{"broken": ', "application/json", "{&#34;broken&#34;: ", "text"),
        (b"", None, "Empty body.", "empty"),
    ],
)
def test_bodies_of_every_kind(admin_app, admin, body, content_type, expected, kind):
    event_id = event(admin_app, body=body, content_type=content_type)
    page = text(admin.get(f"/admin/events/{event_id}"))
    assert expected in page
    assert f"{kind}, {len(body)} bytes" in page


def test_missing_event_is_404(admin):
    assert admin.get("/admin/events/424242").status_code == 404


def test_broker_sources_are_offered_as_a_filter_beside_webhook_sources(make_app):
    from ..conftest import CLIENTS
    from .conftest import PASSWORD, login

    app = make_app(
        {
            "clients": CLIENTS,
            "sources": {
                "orders": {
                    "provider": "rabbitmq",
                    "url": "amqp://guest:secret-pw@127.0.0.1:5672/%2F",
                    "queue": "orders",
                },
                "shop": {"provider": "github", "secrets": ["s"]},
            },
        },
        ADMIN_PASSWORD=PASSWORD,
    )
    client = app.test_client()
    login(client)
    page = client.get("/admin/events").get_data(as_text=True)
    assert '<option value="orders"' in page or ">orders</option>" in page
    assert ">shop</option>" in page or '<option value="shop"' in page
    assert "secret-pw" not in page
