"""Signed webhook deliveries refused for their content, as the admin's Rejections page lists them.

The receipt writes them as ``refused-<problem>`` rows (webhooks/receipt.py):
a webhook's, with its address, never a broker's dead letter; the overview's
signature failures still count unauthentic deliveries alone.
"""

from __future__ import annotations

import re
import time

import pytest

from webhook_receiver.models import Rejection

from ..helpers import post_webhook, rows
from ..helpers import signing as s
from .conftest import PASSWORD, text
from .test_intakes import cells
from .test_overview import metrics

ADDRESS = "203.0.113.9"


@pytest.fixture
def admin_app(make_app):
    return make_app({"sources": s.SOURCES}, ADMIN_PASSWORD=PASSWORD)


def post(client, body: bytes, headers: dict[str, str]):
    return post_webhook(client, "stripe-live", body, headers, environ_base={"REMOTE_ADDR": ADDRESS})


def test_refused_signed_deliveries_are_listed_as_webhook_rows(admin_app, admin):
    client = admin_app.test_client()
    no_key, headers = s.stripe_delivery({"type": "invoice.paid"})
    assert post(client, no_key, headers).status_code == 400
    not_json = b"{not json"
    headers = s.stripe_signed(not_json, int(time.time()))
    assert post(client, not_json, headers).status_code == 400
    unlabelled, headers = s.stripe_delivery({"id": "evt_2", "type": "invoice.paid"})
    del headers["Content-Type"]
    assert post(client, unlabelled, headers).status_code == 415
    forged, headers = s.stripe_delivery({"id": "evt_3"}, secret="whsec_not_ours")
    assert post(client, forged, headers).status_code == 401
    reasons = sorted(r.reason for r in rows(admin_app, Rejection))
    assert reasons == [
        "refused-dedup-key-missing",
        "refused-payload-invalid",
        "refused-unsupported-media-type",
        "signature",
    ]

    page = text(admin.get("/admin/rejections"))
    assert "signed webhook deliveries refused for their content" in page
    listed = {}
    for row in re.findall(r"<tr>\s*<td class=\"nowrap\">.*?</tr>", page, re.S):
        _, source, intake, reason, count, _, _, address = cells(row, "<td")
        listed[reason[0]] = (source, intake, count, address, " ".join(reason[1:]))
    assert set(listed) == set(reasons)
    for reason, (source, intake, count, address, _) in listed.items():
        assert (source, intake, count, address) == (
            ["stripe-live"],
            ["webhook"],
            ["1"],
            [ADDRESS],
        ), reason
    assert listed["refused-dedup-key-missing"][4] == (
        "signed, but no dedup key could be found in it"
    )
    assert listed["refused-payload-invalid"][4] == (
        "signed, but its body or a value in it cannot be read or stored"
    )
    assert listed["refused-unsupported-media-type"][4] == (
        "signed, but its Content-Type is missing or cannot be stored"
    )

    # Signature failures are the unauthentic delivery alone.
    day, week = metrics(text(admin.get("/admin/")))
    assert day["rejections"] == week["rejections"] == 1


def test_the_source_filter_keeps_a_webhook_sources_refusals(admin_app, admin):
    client = admin_app.test_client()
    body, headers = s.stripe_delivery({"type": "invoice.paid"})
    assert post(client, body, headers).status_code == 400
    page = text(admin.get("/admin/rejections?source=stripe-live"))
    _, source, intake, reason, *_ = cells(page, "<td>stripe-live</td>")
    assert (source, intake) == (["stripe-live"], ["webhook"])
    assert reason[0] == "refused-dedup-key-missing"


def test_a_removed_sources_refusal_is_still_a_webhooks():
    from webhook_receiver.admin import presenters

    assert presenters.rejection_intake("gone", "refused-payload-invalid", {}) == "webhook"
    assert presenters.rejection_intake("gone", "payload-invalid", {}) == "broker"


def test_a_delivery_unreadable_before_its_signature_is_a_webhooks_signature_failure(
    admin_app, admin
):
    # Refused before any signature was checked (a doubled webhook-id): its
    # sender is unknown, so it is listed and counted with the forgeries.
    client = admin_app.test_client()
    body, headers = s.delivery_for("svix", "msg_1")
    headers = {**headers, "webhook-id": "msg_1,msg_1", "webhook-signature": "v1,forged"}
    response = post_webhook(client, "svix", body, headers, environ_base={"REMOTE_ADDR": ADDRESS})
    assert response.status_code == 400
    page = text(admin.get("/admin/rejections"))
    _, source, intake, reason, count, _, _, address = cells(page, "<td>svix</td>")
    assert (source, intake, count, address) == (["svix"], ["webhook"], ["1"], [ADDRESS])
    assert " ".join(reason) == "unreadable refused before its signature could be checked"
    day, week = metrics(text(admin.get("/admin/")))
    assert day["rejections"] == week["rejections"] == 1
