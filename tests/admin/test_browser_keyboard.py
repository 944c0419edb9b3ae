"""In a real headless Chromium, by keyboard alone: past the header's ten links in one key.

Every page starts with the same header (eight links, two buttons): a
keyboard user tabbed through all of them on every page to reach a filter.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import PASSWORD, delivery, event
from .test_browser import admin_page, sync_playwright  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]

FOCUSED = "document.activeElement.textContent.trim()"


def test_the_first_tab_skips_to_the_page_content(
    request,
    make_app,
    db_url,
    tmp_path: Path,
    sync_playwright,  # noqa: F811 (the fixture of test_browser, imported above)
):
    app = make_app(ADMIN_PASSWORD=PASSWORD)
    delivery(app, event(app), state="dead", attempts=8)
    with admin_page(sync_playwright, db_url, tmp_path) as (server, page):
        page.fill("#password", PASSWORD)
        page.keyboard.press("Enter")
        page.wait_for_url(f"{server.url}/admin/")
        page.goto(f"{server.url}/admin/dead")
        page.keyboard.press("Tab")
        assert page.evaluate(FOCUSED) == "Skip to content"
        # Shown when focused: a sighted keyboard user sees where the key goes.
        box = page.locator(":focus").bounding_box()
        assert box and box["width"] > 20 and box["x"] >= 0 and box["y"] >= 0
        page.keyboard.press("Enter")
        page.keyboard.press("Tab")
        # The first control of the page itself: the consumer filter.
        assert page.evaluate("document.activeElement.name") == "consumer"
