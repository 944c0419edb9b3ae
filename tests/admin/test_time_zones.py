"""Every time the admin shows says its time zone: in the cell, or in its column's header."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from .conftest import conflict, delivery, event, idempotency_record, rejection, text

# A time as presenters.utc renders it.
_TIME = re.compile(r"\b\d{4}-\d{2}-\d{2} \d{2}:\d{2}(:\d{2})?\b")


class _Tables(HTMLParser):
    """Each table's header texts and, per body row, its cells' texts (nested tables apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[list[str], list[list[str]]]] = []
        self._stack: list[tuple[list[str], list[list[str]]]] = []
        self._cell: list[str] | None = None
        self._in_head = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._stack.append(([], []))
        elif tag == "thead":
            self._in_head = True
        elif tag == "tr" and self._stack and not self._in_head:
            self._stack[-1][1].append([])
        elif tag in ("th", "td") and self._stack:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "table" and self._stack:
            self.tables.append(self._stack.pop())
        elif tag == "thead":
            self._in_head = False
        elif tag in ("th", "td") and self._stack and self._cell is not None:
            cell = " ".join("".join(self._cell).split())
            head, rows = self._stack[-1]
            if self._in_head:
                head.append(cell)
            elif rows:
                rows[-1].append(cell)
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def unzoned_columns(page: str) -> list[str]:
    """The headers of columns holding a time that neither they nor the cell call UTC."""
    parser = _Tables()
    parser.feed(page)
    found = []
    for head, rows in parser.tables:
        for row in rows:
            for index, cell in enumerate(row):
                if _TIME.search(cell) and "UTC" not in cell:
                    header = head[index] if index < len(head) else "(no header)"
                    if "UTC" not in header:
                        found.append(header)
    return sorted(set(found))


def test_every_time_in_a_table_names_its_zone(admin_app, admin):
    target = event(admin_app)
    delivery(admin_app, target, state="pending", attempts=1, last_error="HTTP 503")
    delivery(admin_app, target, consumer="audit", state="dead", attempts=8)
    conflict_id = conflict(admin_app, target)
    idempotency_record(admin_app)
    rejection(admin_app)
    pages = [
        "/admin/",
        "/admin/events",
        f"/admin/events/{target}",
        "/admin/deliveries",
        "/admin/dead",
        "/admin/conflicts",
        f"/admin/conflicts/{conflict_id}",
        "/admin/idempotency",
        "/admin/rejections",
        "/admin/targets",
        "/admin/replays",
    ]
    unzoned = {}
    for path in pages:
        response = admin.get(path)
        assert response.status_code == 200, path
        columns = unzoned_columns(text(response))
        if columns:
            unzoned[path] = columns
    assert unzoned == {}


def test_the_charts_hours_name_their_zone(admin_app, admin):
    event(admin_app)
    page = text(admin.get("/admin/"))
    hours = re.findall(r"<title>(\d{4}-\d{2}-\d{2} \d{2}:00[^<]*)</title>", page)
    assert len(hours) == 24
    assert all(" UTC" in hour for hour in hours), hours[:2]
