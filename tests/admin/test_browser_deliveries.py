"""In a real headless Chromium against gunicorn: a forward's attempts, a replay, a bulk replay.

A forward that fails twice then succeeds (a real downstream, the real
worker) shows its three attempts on the event page; the operator replays it
with a new key from there, and then every delivered one from the Deliveries
page, after its count. Screenshots land in test-artifacts/.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from webhook_receiver import inbox
from webhook_receiver.processing.worker import Worker

from ..processing.conftest import Downstream, Reply
from ..servers import gunicorn
from .conftest import PASSWORD
from .test_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, sync_playwright  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SOURCE = {
    "provider": "generic",
    "secrets": ["shop-secret-0123456789"],
    "signature_header": "X-Signature",
}


def _config_toml(url: str) -> str:
    return "\n".join(
        [
            "[sources.shop]",
            'provider = "generic"',
            'secrets = ["shop-secret-0123456789"]',
            'signature_header = "X-Signature"',
            "[[sources.shop.forward]]",
            'name = "billing"',
            f"url = {json.dumps(url)}",
            "timeout_seconds = 2",
            "",
        ]
    )


def _work(app) -> int:
    """Run the worker until nothing is due (retries are due at once here)."""
    with app.app_context():
        return Worker(app).run(drain=True, handle_signals=False)


def test_operator_sees_three_attempts_and_replays_them(
    request,
    make_app,
    db_url,
    tmp_path: Path,
    sync_playwright,  # noqa: F811 (the fixture of test_browser, imported above)
):
    sink = Downstream()
    sink.start()
    sink.replies["/billing"] = [
        Reply(500, body=b"database on fire"),
        Reply(502, body=b"bad gateway"),
        Reply(200, body=b'{"received": true}'),
    ]
    url = sink.url + "/billing"
    forward = {"name": "billing", "url": url, "timeout_seconds": 2}
    app = make_app(
        {"sources": {"shop": {**SOURCE, "forward": [forward]}}},
        ADMIN_PASSWORD=PASSWORD,
        WORKER_BACKOFF_BASE_SECONDS=0,
        WORKER_POLL_SECONDS=0.05,
    )
    with app.app_context():
        outcome = inbox.receive(
            inbox.Message(
                source="shop",
                dedup_key="order-77",
                fingerprint="f" * 64,
                body=b'{"type": "order.paid", "data": {"order": 77}}',
                event_type="order.paid",
                content_type="application/json",
            )
        )
    event_id = outcome.event_id
    assert _work(app) == 3
    assert [c.headers["Idempotency-Key"] for c in sink.calls] == ["billing:shop:order-77"] * 3

    engine = request.node.callspec.params["db_url"]
    ARTIFACTS.mkdir(exist_ok=True)
    env = {"WEBHOOK_RECEIVER_ADMIN_PASSWORD": PASSWORD}
    try:
        with (
            gunicorn(db_url, _config_toml(url), tmp_path, env=env) as server,
            sync_playwright() as p,
        ):
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                violations: list[str] = []
                page.on(
                    "console",
                    lambda m: (
                        violations.append(m.text) if "Content Security Policy" in m.text else None
                    ),
                )
                page.goto(f"{server.url}/admin/events/{event_id}")
                page.fill("#password", PASSWORD)
                page.click("button[type=submit]")
                page.wait_for_url(f"{server.url}/admin/events/{event_id}")

                # Three attempts, each with its outcome and status.
                panel = page.locator("tr.attempts table.attempts tbody tr")
                assert panel.count() == 3
                assert panel.locator(".attempt-outcome").all_inner_texts() == [
                    "retryable failure",
                    "retryable failure",
                    "delivered",
                ]
                assert panel.locator(".attempt-status").all_inner_texts() == ["500", "502", "200"]
                assert "HTTP 500: database on fire" in panel.nth(0).inner_text()
                panel.nth(2).locator("summary").click()
                assert panel.nth(2).locator("pre.body").inner_text() == '{"received": true}'
                page.screenshot(
                    path=str(ARTIFACTS / f"admin-event-attempts-{engine}.png"), full_page=True
                )

                # Replay it to billing with a new key.
                page.select_option("#replay select[name=consumer]", "billing")
                page.check("#replay input[name=new_key]")
                page.click("#replay button[type=submit]")
                page.wait_for_selector(".flash-success")
                assert (
                    "queued 1 delivery again, each with a new key."
                    in page.locator(".flash-success").inner_text()
                )
                assert page.locator("td.delivery-state").first.inner_text() == "pending"
                assert _work(app) == 1
                assert sink.calls[-1].headers["Idempotency-Key"] == "billing:shop:order-77:replay-1"
                page.reload()
                assert panel.count() == 4
                assert panel.nth(3).locator("td").first.inner_text() == "#1 replay 1"
                assert panel.nth(3).locator(".attempt-outcome").inner_text() == "delivered"

                # Every delivered delivery of billing, from the Deliveries page.
                page.click("nav >> text=Deliveries")
                page.wait_for_url(f"{server.url}/admin/deliveries")
                page.fill("form.filters input[name=consumer]", "billing")
                page.select_option("form.filters select[name=state]", "delivered")
                page.click("form.filters button[type=submit]")
                page.wait_for_url(re.compile(r".*state=delivered.*"))
                assert page.locator("#deliveries tbody tr").count() == 1
                page.screenshot(
                    path=str(ARTIFACTS / f"admin-deliveries-{engine}.png"), full_page=True
                )
                page.click("#bulk-replay button[type=submit]")
                page.wait_for_url(re.compile(r".*/admin/deliveries/replay\?.*"))
                assert page.locator("#replay-count").inner_text() == "1 delivery matches."
                # Without the confirmation the browser does not send the form.
                page.click("form.card button[type=submit]")
                assert page.locator("input[name=confirm]:invalid").count() == 1
                page.check("input[name=confirm]")
                page.screenshot(
                    path=str(ARTIFACTS / f"admin-replay-confirm-{engine}.png"), full_page=True
                )
                page.click("form.card button[type=submit]")
                page.wait_for_url(f"{server.url}/admin/replays")
                flashed = page.locator(".flash-success").inner_text()
                assert "1 delivery to queue again" in flashed
                rows = page.locator("#replays tbody tr")
                assert rows.count() == 2
                assert "consumer=billing, state=delivered" in rows.first.inner_text()
                assert "admin from 127.0.0.1" in rows.first.inner_text()
                assert "waiting for a worker" in rows.first.inner_text()
                assert _work(app) == 1  # a worker runs the replay first, then sends it
                page.reload()
                assert "waiting for a worker" not in rows.first.inner_text()
                page.screenshot(path=str(ARTIFACTS / f"admin-replays-{engine}.png"), full_page=True)
                # The default keeps the delivery's key, :replay-1 since the replay above.
                assert sink.calls[-1].headers["Idempotency-Key"] == "billing:shop:order-77:replay-1"
                assert len(sink.calls) == 5
                assert violations == []
            finally:
                browser.close()
    finally:
        sink.close()
