"""In a real headless Chromium: the admin's pages at 320 CSS pixels wide (1280 at 400% zoom).

WCAG's reflow rule: at that width the page itself must not scroll sideways;
a wide table may scroll inside its own box, the rest of the page stays put.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import PASSWORD, conflict, delivery, event, idempotency_record, rejection
from .test_browser import ARTIFACTS, admin_page, log_in, sync_playwright  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]

LONG_KEY = "evt_" + "x" * 500  # the longest a dedup key may be, unbroken
PAGES = [
    "/admin/",
    "/admin/events",
    "/admin/deliveries",
    "/admin/conflicts",
    "/admin/dead",
    "/admin/idempotency",
    "/admin/rejections",
    "/admin/targets",
    "/admin/replays",
]


def _page_overflow(page) -> int:
    """How many pixels the page itself scrolls sideways."""
    return page.evaluate(
        "document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )


def test_no_page_scrolls_sideways_at_400_percent_zoom(
    request,
    make_app,
    db_url,
    tmp_path: Path,
    sync_playwright,  # noqa: F811 (the fixture of test_browser, imported above)
):
    app = make_app(ADMIN_PASSWORD=PASSWORD)
    target = event(app, dedup_key=LONG_KEY, event_type="invoice." + "y" * 240)
    delivery(app, target, state="dead", attempts=8, last_error="HTTP 502 " + "z" * 500)
    conflict_id = conflict(app, target)
    idempotency_record(app, key="k-" + "q" * 250)
    rejection(app, detail="no signature matched " + "w" * 400)
    pages = [*PAGES, f"/admin/events/{target}", f"/admin/conflicts/{conflict_id}"]

    engine = request.node.callspec.params["db_url"]
    ARTIFACTS.mkdir(exist_ok=True)
    with admin_page(sync_playwright, db_url, tmp_path, width=320, height=640) as (server, page):
        assert _page_overflow(page) == 0
        log_in(server, page)
        wide = {}
        for path in pages:
            page.goto(server.url + path)
            name = path.strip("/").replace("/", "-")
            page.screenshot(path=str(ARTIFACTS / f"narrow-{name}-{engine}.png"), full_page=True)
            overflow = _page_overflow(page)
            if overflow:
                wide[path] = overflow
        assert wide == {}
