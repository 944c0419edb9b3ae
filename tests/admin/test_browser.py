"""End to end in a real headless Chromium against gunicorn: log in, filter, open, requeue, discard.

Needs Debian's ``chromium`` at /usr/bin/chromium (``.ci/run`` installs it)
and Playwright for Python. Without them the test skips locally but fails in
CI, where it must run. Screenshots land in test-artifacts/.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests

from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery, utcnow

from ..conftest import ACME_TOKEN
from ..helpers import unavailable
from ..servers import ROOT, gunicorn, wait_until
from .conftest import PASSWORD, conflict, delivery, duplicate, event

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = ROOT / "test-artifacts"
CONFIG = f"""
[clients.acme]
token = "{ACME_TOKEN}"
"""


@pytest.fixture
def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed")
    if not os.access(CHROMIUM, os.X_OK):
        unavailable(f"{CHROMIUM} is missing (apt-get install chromium)")
    return sync_playwright


@contextmanager
def admin_page(
    sync_playwright, db_url: str, tmp_path: Path, *, width: int = 1280, height: int = 900
) -> Iterator[tuple[Any, Any]]:
    """gunicorn with the admin on (client acme), and a Chromium page at its login form."""
    env = {"WEBHOOK_RECEIVER_ADMIN_PASSWORD": PASSWORD}
    with gunicorn(db_url, CONFIG, tmp_path, env=env) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(f"{server.url}/admin/login")
            yield server, page
        finally:
            browser.close()


def log_in(server, page) -> None:
    """Log the page in with the form, and wait for the overview."""
    page.fill("#password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server.url}/admin/")


def session_cookie_paths(page) -> list[str]:
    return [c["path"] for c in page.context.cookies() if c["name"] == "session"]


def test_operator_finds_a_dead_delivery_and_requeues_it(
    request, make_app, db_url, tmp_path: Path, sync_playwright
):
    app = make_app(ADMIN_PASSWORD=PASSWORD)
    target = event(
        app,
        source="stripe",
        event_type="invoice.payment_failed",
        dedup_key="evt_browser_dead",
        body=b'{"id": "evt_browser_dead", "note": "<script>alert(1)</script>", "amount": 4200}',
        headers=[["Content-Type", "application/json"], ["Stripe-Signature", "t=1,v1=abc"]],
    )
    dead_id = delivery(
        app,
        target,
        consumer="billing",
        state="dead",
        attempts=8,
        last_error="HTTP 502 Bad Gateway from https://billing.internal/hooks",
        response_status=502,
    )
    conflict(
        app,
        target,
        body=b'{"id": "evt_browser_dead", "note": "<script>alert(1)</script>", "amount": 4300}',
    )
    # A consumer since removed from the config: its dead letter can only be discarded.
    gone_id = delivery(
        app,
        target,
        consumer="legacy",
        state="dead",
        attempts=8,
        last_error="consumer 'legacy' is no longer configured",
    )
    now = utcnow()
    delivery(app, target, consumer="audit", state="delivered", attempts=1, completed_at=now)
    duplicate(app, target)
    # Some history for the chart: events over the last hours, every other one redelivered.
    for n in range(6):
        at = now - timedelta(hours=n * 3, minutes=n)
        other = event(
            app,
            source="github",
            event_type="push",
            dedup_key=f"gh-{n}",
            received_at=at,
        )
        delivery(app, other, consumer="ci", state="delivered", attempts=1, completed_at=at)
        if n % 2:
            duplicate(app, other, at + timedelta(minutes=2))

    engine = request.node.callspec.params["db_url"]
    ARTIFACTS.mkdir(exist_ok=True)
    env = {"WEBHOOK_RECEIVER_ADMIN_PASSWORD": PASSWORD}
    with gunicorn(db_url, CONFIG, tmp_path, env=env) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            violations: list[str] = []
            page.on(
                "console",
                lambda m: (
                    violations.append(m.text) if "Content Security Policy" in m.text else None
                ),
            )

            # Log in: the admin sends us to the form first.
            page.goto(f"{server.url}/admin/")
            assert "/admin/login" in page.url
            page.fill("#password", "wrong")
            page.click("button[type=submit]")
            assert page.locator(".flash-error").inner_text() == "Wrong password."
            page.fill("#password", PASSWORD)
            page.click("button[type=submit]")
            page.wait_for_url(f"{server.url}/admin/")
            # The session cookie is the admin's alone: not sent to webhooks or the API.
            assert session_cookie_paths(page) == ["/admin"]
            assert page.locator("h1").inner_text() == "Overview"
            # The stylesheet loaded under the CSP (the page is styled).
            background = page.evaluate("getComputedStyle(document.body).backgroundColor")
            assert background == "rgb(246, 248, 250)"
            assert page.locator("svg.chart rect.bar-received").count() == 24
            page.screenshot(path=str(ARTIFACTS / f"admin-overview-{engine}.png"), full_page=True)

            # Filter the event list down to the event with a dead delivery.
            page.click("nav >> text=Events")
            page.wait_for_url(f"{server.url}/admin/events")
            assert page.locator("#events tbody tr").count() == 7
            page.screenshot(path=str(ARTIFACTS / f"admin-events-{engine}.png"), full_page=True)
            page.select_option("select[name=state]", "dead")
            page.fill("input[name=source]", "stripe")
            page.click("form.filters button[type=submit]")
            page.wait_for_url(re.compile(r".*state=dead.*"))
            rows = page.locator("#events tbody tr")
            assert rows.count() == 1
            assert "evt_browser_dead" in rows.first.inner_text()

            # Open it: the payload is shown as text, the dead delivery has its button.
            rows.first.locator("a").first.click()
            page.wait_for_url(f"{server.url}/admin/events/{target}")
            assert "<script>alert(1)</script>" in page.locator("pre.body").first.inner_text()
            dead_row = page.locator(f'tr[data-delivery-id="{dead_id}"]')
            assert dead_row.locator(".delivery-state").inner_text() == "dead"
            assert "HTTP 502 Bad Gateway" in dead_row.inner_text()
            page.screenshot(path=str(ARTIFACTS / f"admin-event-{engine}.png"), full_page=True)

            # Requeue it and see the state change.
            dead_row.locator("button", has_text="Requeue").click()
            page.wait_for_url(f"{server.url}/admin/events/{target}")
            assert page.locator(".flash-success").inner_text() == "Requeued 1 delivery."
            assert dead_row.locator(".delivery-state").inner_text() == "pending"
            assert dead_row.locator("button", has_text="Requeue").count() == 0
            page.screenshot(
                path=str(ARTIFACTS / f"admin-event-requeued-{engine}.png"), full_page=True
            )

            # An API event, found by the Idempotency-Key its client sent; its replay
            # is one of its duplicates.
            order = {"type": "order.created", "data": {"order": 42}}
            api_headers = {"Authorization": f"Bearer {ACME_TOKEN}", "Idempotency-Key": "order-42"}
            created = requests.post(
                f"{server.url}/api/events", json=order, headers=api_headers, timeout=30
            )
            assert created.status_code == 201, created.text
            replayed = requests.post(
                f"{server.url}/api/events", json=order, headers=api_headers, timeout=30
            )
            assert replayed.headers["Idempotent-Replayed"] == "true"
            page.click("nav >> text=Events")
            page.wait_for_url(f"{server.url}/admin/events")
            page.fill("input[name=q]", "order-42")
            page.click("form.filters button[type=submit]")
            page.wait_for_url(re.compile(r".*q=order-42.*"))
            rows = page.locator("#events tbody tr")
            assert rows.count() == 1
            assert "order-42" in rows.first.inner_text()
            rows.first.locator("a").first.click()
            page.wait_for_url(f"{server.url}/admin/events/{created.json()['id']}")
            assert page.locator("#key").inner_text() == "order-42"
            assert page.locator("dd.event-type").inner_text() == "order.created"

            def replay_shown() -> bool:
                page.reload()
                return page.locator("#duplicates li").count() == 1

            # Redeliveries are written in batches, within a second.
            assert wait_until(replay_shown, timeout=20, interval=0.5)
            page.screenshot(path=str(ARTIFACTS / f"admin-api-event-{engine}.png"), full_page=True)

            # The conflict, side by side.
            page.click("nav >> text=Conflicts")
            page.wait_for_url(f"{server.url}/admin/conflicts")
            page.locator("#conflicts tbody tr a").first.click()
            page.wait_for_url(re.compile(r".*/admin/conflicts/\d+$"))
            assert page.locator("#body-diff tr.diff-replace mark").count() == 2
            page.screenshot(path=str(ARTIFACTS / f"admin-conflict-{engine}.png"), full_page=True)

            # The dead-letter list holds the legacy consumer's delivery only now.
            page.click("nav >> text=Dead letters")
            page.wait_for_url(f"{server.url}/admin/dead")
            assert page.locator("#dead tbody tr").count() == 1
            page.check(f'input[name=ids][value="{gone_id}"]')
            # Without the confirmation the browser does not send the form (no script needed).
            page.click("button:has-text('Discard selected')")
            assert page.locator("input[name=confirm]:invalid").count() == 1
            assert page.url == f"{server.url}/admin/dead"
            assert page.locator(".flash").count() == 0
            assert page.locator("#dead tbody tr").count() == 1
            page.check("input[name=confirm]")
            page.screenshot(
                path=str(ARTIFACTS / f"admin-dead-discard-{engine}.png"), full_page=True
            )
            page.click("button:has-text('Discard selected')")
            page.wait_for_selector(".flash-success")
            assert page.locator(".flash-success").inner_text() == "Discarded 1 delivery."
            assert "No dead deliveries." in page.locator("#dead").inner_text()
            page.goto(f"{server.url}/admin/events/{target}")
            gone_row = page.locator(f'tr[data-delivery-id="{gone_id}"]')
            assert gone_row.locator(".delivery-state").inner_text() == "discarded"
            assert gone_row.locator("button").count() == 0

            # Log out.
            page.click("text=Log out")
            page.wait_for_url(f"{server.url}/admin/login")
            assert session_cookie_paths(page) == ["/admin"]  # replaced, not doubled
            page.goto(f"{server.url}/admin/events")
            assert "/admin/login" in page.url
            assert violations == []
        finally:
            browser.close()

    with app.app_context():
        row = db.session.get(Delivery, dead_id)
        assert (row.state, row.attempts) == ("pending", 0)
        assert db.session.get(Delivery, gone_id).state == "discarded"
