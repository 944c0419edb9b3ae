"""What a screen reader announces: every column header and button has a name of its own."""

from __future__ import annotations

import re

from .conftest import delivery, event, idempotency_record, text

_TH = re.compile(r"<th\b[^>]*>(.*?)</th>", re.S)
_TAG = re.compile(r"<[^>]+>")


def test_every_column_header_has_a_name(admin_app, admin):
    target = event(admin_app)
    delivery(admin_app, target, state="dead", attempts=8)
    idempotency_record(admin_app)
    nameless = {}
    for path in ["/admin/events", f"/admin/events/{target}", "/admin/dead", "/admin/idempotency"]:
        page = text(admin.get(path))
        empty = [th for th in _TH.findall(page) if not _TAG.sub("", th).strip()]
        if empty:
            nameless[path] = len(empty)
    assert nameless == {}


def test_the_log_out_everywhere_button_says_what_it_does(admin):
    # Its visible word alone ("everywhere") names no action to a screen reader.
    page = text(admin.get("/admin/"))
    button = re.search(r'<button[^>]*name="everywhere"[^>]*>', page).group(0)
    assert 'aria-label="Log out everywhere"' in button
