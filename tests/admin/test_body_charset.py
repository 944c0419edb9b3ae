"""A text body in the charset its Content-Type names is shown as text, not as a hex dump."""

from __future__ import annotations

import html

import pytest

from webhook_receiver.admin import presenters

from .conftest import conflict, event, text


def test_a_latin1_body_reads_as_text_on_the_event_page(admin_app, admin):
    # A legacy sender's form post or CSV, in the charset its header names.
    body = "name=Zoë&city=Malmö&note=crème brûlée".encode("iso-8859-1")
    target = event(admin_app, body=body, content_type="text/plain; charset=ISO-8859-1")
    page = html.unescape(text(admin.get(f"/admin/events/{target}")))
    assert "name=Zoë&city=Malmö&note=crème brûlée" in page
    assert "Not text: shown as bytes" not in page
    assert "text (iso-8859-1)" in page


def test_a_windows_1252_conflict_is_compared_as_text(admin_app, admin):
    target = event(
        admin_app,
        body="price: 5 €".encode("cp1252"),
        content_type="text/plain; charset=windows-1252",
    )
    conflict_id = conflict(
        admin_app,
        target,
        body="price: 6 €".encode("cp1252"),
        content_type="text/plain; charset=windows-1252",
    )
    page = html.unescape(text(admin.get(f"/admin/conflicts/{conflict_id}")))
    assert "price: 5 €" in page.replace("<mark>", "").replace("</mark>", "")
    assert "price: 6 €" in page.replace("<mark>", "").replace("</mark>", "")


@pytest.mark.parametrize(
    ("body", "content_type", "kind"),
    [
        ("héllo".encode("utf-16"), "text/plain; charset=utf-16", "text"),
        (b"caf\xe9", "text/plain; charset=no-such-charset", "binary"),  # unknown: bytes
        (b"caf\xe9", "text/plain; charset=utf-8", "binary"),  # not what it says: bytes
        (b"caf\xe9", "text/plain; charset=zlib", "binary"),  # not a text encoding
        (b"caf\xe9", "text/plain", "binary"),  # no charset: UTF-8 or bytes, as before
        (b"\x00\x01", "text/plain; charset=latin-1", "binary"),  # control bytes: bytes
    ],
)
def test_the_named_charset_is_used_only_when_it_reads_the_body(body, content_type, kind):
    assert presenters.show_body(body, content_type).kind == kind
