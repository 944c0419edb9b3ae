"""The overview's hourly chart as a table: its numbers without a mouse or eyes."""

from __future__ import annotations

from datetime import timedelta

from webhook_receiver.models import utcnow

from .conftest import duplicate, event, text
from .test_time_zones import _Tables


def test_the_hourly_numbers_are_in_a_table_too(admin_app, admin):
    # A bar's number was only in its hover tooltip, which neither a keyboard
    # nor a screen reader (the chart is one image to it) can reach.
    now = utcnow()
    two_hours_ago = now - timedelta(hours=2)
    for _ in range(3):
        event(admin_app, received_at=two_hours_ago)
    first = event(admin_app, received_at=now - timedelta(hours=30))
    duplicate(admin_app, first, two_hours_ago)
    parser = _Tables()
    parser.feed(text(admin.get("/admin/")))
    hourly = [(head, rows) for head, rows in parser.tables if head and head[0].startswith("Hour")]
    assert len(hourly) == 1
    head, rows = hourly[0]
    assert head == ["Hour (UTC)", "Received", "Duplicates"]
    assert len(rows) == 24
    hour = two_hours_ago.strftime("%Y-%m-%d %H:00")
    assert [hour, "3", "1"] in rows
    assert rows[0][0] < rows[-1][0]  # oldest first, as the bars
