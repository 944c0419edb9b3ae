"""A page link that is not valid says to start from the first page, and links to it."""

from __future__ import annotations

import html
import re

import pytest

from .conftest import event, text


@pytest.mark.parametrize(
    ("url", "first"),
    [
        (
            "/admin/events?source=stripe&state=dead&before=garbled",
            "/admin/events?source=stripe&state=dead",
        ),
        ("/admin/dead?after=1.x", "/admin/dead"),
        ("/admin/conflicts?view=all&before=-", "/admin/conflicts?view=all"),
        ("/admin/replays?after=1.", "/admin/replays"),
    ],
)
def test_a_garbled_page_link_offers_the_first_page_with_its_filters(admin_app, admin, url, first):
    event(admin_app)  # the source "stripe" is then known
    response = admin.get(url)
    assert response.status_code == 400
    page = text(response)
    assert "start again from the first page" in page
    links = [html.unescape(href) for href in re.findall(r'<a href="([^"]+)">First page</a>', page)]
    assert links == [first]
    assert admin.get(first).status_code == 200
