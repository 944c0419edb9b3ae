"""In a real headless Chromium: evicting an Idempotency-Key asks for a confirmation first.

Evicting lets the client's next request with the key run afresh (a second
order, a second charge) and cannot be undone: one stray click must not do it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import PASSWORD, idempotency_record
from .test_browser import ARTIFACTS, admin_page, log_in, sync_playwright  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_a_key_is_evicted_only_once_confirmed(
    request,
    make_app,
    db_url,
    tmp_path: Path,
    sync_playwright,  # noqa: F811 (the fixture of test_browser, imported above)
):
    app = make_app(ADMIN_PASSWORD=PASSWORD)
    record_id = idempotency_record(app, key="order-42")
    engine = request.node.callspec.params["db_url"]
    ARTIFACTS.mkdir(exist_ok=True)
    with admin_page(sync_playwright, db_url, tmp_path) as (server, page):
        log_in(server, page)
        page.goto(f"{server.url}/admin/idempotency")
        row = page.locator(f"tr[data-record-id='{record_id}']")

        # One click on what the row offers: the key is still there.
        row.get_by_text("Evict").first.click()
        page.wait_for_timeout(300)
        page.goto(f"{server.url}/admin/idempotency")
        assert row.count() == 1
        assert page.locator(".flash").count() == 0

        # Nor is it evicted without the confirmation ticked.
        row.get_by_text("Evict").first.click()
        row.get_by_role("button", name="Evict").click()
        page.wait_for_timeout(300)
        page.goto(f"{server.url}/admin/idempotency")
        assert row.count() == 1

        # Confirmed: it goes, and the page says so.
        row.get_by_text("Evict").first.click()
        row.get_by_label("Its next request runs afresh").check()
        page.screenshot(path=str(ARTIFACTS / f"admin-evict-confirm-{engine}.png"))
        row.get_by_role("button", name="Evict").click()
        page.wait_for_url(f"{server.url}/admin/idempotency")
        assert page.locator(".flash-success").inner_text().startswith("Evicted the key")
        assert row.count() == 0
        page.screenshot(path=str(ARTIFACTS / f"admin-evicted-{engine}.png"), full_page=True)
