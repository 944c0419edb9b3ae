"""In a real headless Chromium: a long Idempotency-Key or request path is shown whole.

The key list cut both to one line with an ellipsis, and no other page shows
a record: the end of a long key, which often tells keys apart, was nowhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from webhook_receiver.extensions import db
from webhook_receiver.models import IdempotencyRecord

from .conftest import PASSWORD, idempotency_record
from .test_browser import ARTIFACTS, admin_page, log_in, sync_playwright  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]

KEY = "order-" + "0123456789abcdef" * 15 + "-attempt7"  # 255 characters, the most a key has
PATH = "/api/events?" + "&".join(f"tag{n}=value{n}" for n in range(60)) + "&end=here"


def _cut(cell) -> int:
    """How many pixels of a cell's text are hidden, sideways or downwards."""
    return cell.evaluate(
        "e => Math.max(e.scrollWidth - e.clientWidth, e.scrollHeight - e.clientHeight)"
    )


def test_a_long_key_and_path_are_shown_whole(
    request,
    make_app,
    db_url,
    tmp_path: Path,
    sync_playwright,  # noqa: F811 (the fixture of test_browser, imported above)
):
    app = make_app(ADMIN_PASSWORD=PASSWORD)
    assert len(KEY) == 255
    record_id = idempotency_record(app, key=KEY)
    with app.app_context():
        db.session.get(IdempotencyRecord, record_id).path = PATH
        db.session.commit()
    engine = request.node.callspec.params["db_url"]
    ARTIFACTS.mkdir(exist_ok=True)
    with admin_page(sync_playwright, db_url, tmp_path) as (server, page):
        log_in(server, page)
        page.goto(f"{server.url}/admin/idempotency")
        cells = page.locator(f"tr[data-record-id='{record_id}'] td")
        key, request_cell = cells.nth(1), cells.nth(3)
        page.screenshot(path=str(ARTIFACTS / f"admin-long-key-{engine}.png"), full_page=True)
        assert key.inner_text().replace("\n", "") == KEY
        assert _cut(key) == 0
        assert request_cell.inner_text().replace("\n", "") == f"POST {PATH}"
        assert _cut(request_cell) == 0
