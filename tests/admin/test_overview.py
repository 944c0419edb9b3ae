"""The overview: counts for the last day and week, and the hourly chart."""

from __future__ import annotations

import re
from datetime import timedelta

from webhook_receiver.models import AdminLoginFailure, utcnow

from .conftest import add, conflict, delivery, duplicate, event, rejection, text


def metrics(page: str) -> list[dict[str, int]]:
    rows = []
    counts = page[page.index('<table class="counts">') :]
    counts = counts[: counts.index("</table>")]
    for row in counts.split('<th scope="row">')[1:]:
        row = row.split("</tr>")[0]
        rows.append({k: int(v) for k, v in re.findall(r'data-metric="(\w+)">(\d+)<', row)})
    return rows


def test_counts_for_a_day_and_a_week(admin_app, admin):
    now = utcnow()
    hour_ago, three_days_ago, month_ago = (
        now - timedelta(hours=1),
        now - timedelta(days=3),
        now - timedelta(days=30),
    )
    recent = [event(admin_app, received_at=hour_ago) for _ in range(3)]
    older = event(admin_app, received_at=three_days_ago)
    event(admin_app, received_at=month_ago)
    duplicate(admin_app, recent[0], hour_ago)
    duplicate(admin_app, recent[0], hour_ago)
    duplicate(admin_app, older, three_days_ago)
    conflict(admin_app, recent[1], received_at=hour_ago)
    conflict(admin_app, older, received_at=three_days_ago)
    rejection(admin_app, received_at=hour_ago)
    rejection(admin_app, received_at=hour_ago, reason="timestamp")
    rejection(admin_app, received_at=month_ago)
    delivery(admin_app, recent[0], state="delivered", completed_at=hour_ago)
    delivery(admin_app, older, state="delivered", completed_at=three_days_ago)
    delivery(admin_app, recent[1], state="dead", updated_at=hour_ago)
    delivery(admin_app, recent[2], state="dead", updated_at=three_days_ago, consumer="x")
    delivery(admin_app, recent[2], state="pending", consumer="y")
    delivery(admin_app, recent[0], state="discarded", consumer="z", completed_at=hour_ago)
    delivery(admin_app, older, state="discarded", consumer="z", completed_at=three_days_ago)
    add(admin_app, AdminLoginFailure(remote_addr="192.0.2.1", at=now))

    page = text(admin.get("/admin/"))
    day, week = metrics(page)
    assert day == {
        "received": 3,
        "duplicates": 2,
        "conflicts": 1,
        "rejections": 2,
        "delivered": 1,
        "dead": 1,
        "discarded": 1,
    }
    assert week == {
        "received": 4,
        "duplicates": 3,
        "conflicts": 2,
        "rejections": 2,
        "delivered": 2,
        "dead": 2,
        "discarded": 2,
    }
    assert '<span class="n">2</span> dead deliveries' in page
    assert '<span class="n">1</span> deliveries waiting' in page
    assert '<span class="n">2</span> dedup-key conflicts to review' in page


def test_chart_draws_received_and_duplicates_per_hour(admin_app, admin):
    now = utcnow()
    two_hours_ago = now - timedelta(hours=2)
    for _ in range(3):
        event(admin_app, received_at=two_hours_ago)
    first = event(admin_app, received_at=now - timedelta(hours=30))  # out of the chart
    duplicate(admin_app, first, two_hours_ago)
    duplicate(admin_app, first, two_hours_ago)
    page = text(admin.get("/admin/"))
    svg = page[page.index("<svg") : page.index("</svg>")]
    assert svg.count('class="bar-received"') == 24
    assert svg.count('class="bar-duplicates"') == 24
    hour = two_hours_ago.strftime("%Y-%m-%d %H:00")
    assert f"{hour} UTC: 3 received, 2 duplicates" in svg
    assert "<script" not in page
    # The tallest bar reaches the top of the plot; empty hours draw nothing.
    heights = [float(h) for h in re.findall(r'class="bar-received"[^>]*height="([\d.]+)"', svg)]
    assert max(heights) > 0 and heights.count(0.0) == 23


def test_overview_of_an_empty_database(admin):
    page = text(admin.get("/admin/"))
    day, week = metrics(page)
    assert set(day.values()) == {0} and set(week.values()) == {0}
    assert page.count('class="bar-received"') == 24


def test_signature_failures_count_only_refused_webhook_deliveries(admin_app, admin):
    # Rejections also list broker messages dead-lettered without being
    # stored: those are no signature failures, and were counted as such.
    hour_ago = utcnow() - timedelta(hours=1)
    rejection(admin_app, received_at=hour_ago)
    rejection(admin_app, received_at=hour_ago, reason="timestamp")
    for reason in ("dedup-key-missing", "payload-invalid", "message-malformed", "consumer-error"):
        rejection(admin_app, received_at=hour_ago, source="orders", reason=reason, remote_addr=None)
    day, week = metrics(text(admin.get("/admin/")))
    assert day["rejections"] == 2 and week["rejections"] == 2
