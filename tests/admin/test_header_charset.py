"""Header values as the admin shows them: the bytes a sender sent, read as UTF-8 where they are.

A WSGI server hands header values over as Latin-1 (PEP 3333), and the
receiver stores them so: a UTF-8 value (a name with an accent, an emoji)
would show as mojibake ("ZoÃ«") unless read back as UTF-8.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
import requests

from webhook_receiver.admin import presenters

from ..conftest import ACME_TOKEN
from ..servers import gunicorn
from .conftest import PASSWORD, login, text

CONFIG = f"""
[clients.acme]
token = "{ACME_TOKEN}"
"""


@pytest.mark.slow
def test_a_utf8_header_sent_over_http_reads_as_sent(make_app, db_url, tmp_path: Path):
    app = make_app(ADMIN_PASSWORD=PASSWORD)
    customer = "Zoë Ångström שלום 🙂"
    with gunicorn(db_url, CONFIG, tmp_path) as server:
        created = requests.post(
            f"{server.url}/api/events",
            json={"type": "order.created", "data": {"order": 42}},
            headers={
                "Authorization": f"Bearer {ACME_TOKEN}",
                "Idempotency-Key": "order-42",
                "X-Customer": customer.encode(),
                "X-Raw": b"\xff\xfe-not-utf8",
            },
            timeout=30,
        )
    assert created.status_code == 201, created.text
    event_id = created.json()["id"]
    client = app.test_client()
    login(client)
    page = text(client.get(f"/admin/events/{event_id}"))
    shown = dict(
        re.findall(r'<th scope="row" class="mono">([^<]*)</th><td class="mono">([^<]*)</td>', page)
    )
    assert html.unescape(shown["X-Customer"]) == customer
    # Bytes that are not UTF-8 are shown as Latin-1, each byte one character, as received.
    assert html.unescape(shown["X-Raw"]) == "\xff\xfe-not-utf8"


@pytest.mark.parametrize(
    ("stored", "shown"),
    [
        ("Zo\xc3\xab", "Zoë"),  # UTF-8 bytes read as Latin-1 by the server
        ("Zoë", "Zoë"),  # stored as text already (a broker's header): left alone
        ("\xff\xfe", "\xff\xfe"),  # not UTF-8: the bytes as Latin-1
        ("plain", "plain"),
        ("日本", "日本"),  # beyond Latin-1: text already
    ],
)
def test_redact_reads_header_bytes_as_utf8_where_they_are(stored, shown):
    assert presenters.redact([["X-Name", stored]]) == [("X-Name", shown)]
