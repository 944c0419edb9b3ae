"""The pieces the templates are fed: bodies, redaction, the diff, the chart, cursors."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from webhook_receiver.admin import presenters
from webhook_receiver.admin.auth import safe_next
from webhook_receiver.admin.paging import Cursor


def test_json_is_pretty_printed_in_its_own_order():
    body = presenters.show_body(b'{"b":1,"a":[1,2]}', "application/json")
    assert body.kind == "json"
    assert body.text == '{\n  "b": 1,\n  "a": [\n    1,\n    2\n  ]\n}'


def test_json_without_a_json_content_type_is_still_recognised():
    assert presenters.show_body(b'  {"a": 1}', "text/plain").kind == "json"
    assert presenters.show_body(b"12", "text/plain").kind == "text"


def test_binary_bodies_become_a_bounded_hex_dump():
    body = presenters.show_body(bytes(range(256)) * 20, "application/octet-stream")
    assert body.kind == "binary" and body.truncated and body.size == 5120
    lines = body.text.splitlines()
    assert len(lines) == presenters.HEXDUMP_LIMIT // 16
    assert lines[0] == (
        "00000000  00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f  |................|"
    )
    assert presenters.show_body(b"nul\x00byte", None).kind == "binary"
    assert presenters.show_body(b"\xff\xfe", None).kind == "binary"


def test_redaction_catches_credentials_the_store_kept():
    shown = presenters.redact(
        [
            ["Authorization", "Bearer x"],
            ["X-Gitlab-Token", "s3cret"],
            ["X-Api-Key", "k"],
            ["Stripe-Signature", "t=1,v1=abc"],
            ["broken"],
        ]
    )
    assert shown == [
        ("Authorization", "[redacted]"),
        ("X-Gitlab-Token", "[redacted]"),
        ("X-Api-Key", "[redacted]"),
        ("Stripe-Signature", "[redacted]"),
    ]
    assert presenters.redact(None) == []


def test_side_by_side_pairs_changes_and_marks_words():
    rows = presenters.side_by_side(["a", "amount: 100", "b"], ["a", "amount: 250", "b", "c"])
    assert [r.tag for r in rows] == ["equal", "replace", "equal", "insert"]
    replaced = rows[1]
    assert [(s.text, s.changed) for s in replaced.left] == [("amount: ", False), ("100", True)]
    assert [(s.text, s.changed) for s in replaced.right] == [("amount: ", False), ("250", True)]
    assert rows[3].left_no is None and rows[3].right_no == 4


def test_side_by_side_folds_long_unchanged_runs():
    same = [str(i) for i in range(20)]
    rows = presenters.side_by_side(same + ["x"], same + ["y"], context=2)
    assert rows[0].tag == "skip" and rows[0].skipped == 18
    assert [r.tag for r in rows[1:]] == ["equal", "equal", "replace"]
    assert presenters.side_by_side([], []) == []


def test_diff_lines_sort_json_keys_so_order_is_no_difference():
    a = presenters.diff_lines(b'{"a": 1, "b": 2}', "application/json")
    b = presenters.diff_lines(b'{"b": 2, "a": 1}', "application/json")
    assert a == b


def test_chart_layout():
    now = datetime(2024, 5, 1, 12, 30, tzinfo=UTC)
    hours = presenters.hours_ending(now, 24)
    assert hours[-1] == datetime(2024, 5, 1, 12, tzinfo=UTC) and len(hours) == 24
    chart = presenters.hourly_chart(hours, {hours[-1]: 10}, {hours[-1]: 5})
    last = chart.columns[-1]
    assert last.received.height == chart.baseline - chart.top
    assert last.duplicates.height == pytest.approx(last.received.height / 2, abs=0.1)
    assert last.duplicates.x > last.received.x
    assert chart.columns[0].received.height == 0
    assert [t[1] for t in chart.ticks] == [0, 2, 4, 6, 8, 10]
    assert chart.columns[0].label == "13:00" and chart.columns[1].label == ""


@pytest.mark.parametrize(
    ("highest", "ticks"),
    [
        (1, [0, 1]),
        (5, [0, 1, 2, 3, 4, 5]),
        (7, [0, 2, 4, 6, 8]),
        (137, [0, 50, 100, 150]),
        (1000, [0, 200, 400, 600, 800, 1000]),
    ],
)
def test_chart_ticks_are_round_and_evenly_spaced(highest, ticks):
    hours = presenters.hours_ending(datetime(2024, 5, 1, 12, tzinfo=UTC), 24)
    chart = presenters.hourly_chart(hours, {hours[-1]: highest}, {})
    assert [t[1] for t in chart.ticks] == ticks
    gaps = [a[0] - b[0] for a, b in zip(chart.ticks, chart.ticks[1:], strict=False)]
    assert max(gaps) - min(gaps) <= 0.2  # evenly spaced on the axis (to its rounding)
    assert chart.ticks[-1][0] <= chart.columns[-1].received.y  # the bar stays under the top


def test_cursor_round_trip_keeps_microseconds():
    cursor = Cursor(datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC), 42)
    assert Cursor.decode(cursor.encode()) == cursor
    early = Cursor(datetime(1960, 1, 1, tzinfo=UTC) + timedelta(microseconds=1), 1)
    assert Cursor.decode(early.encode()) == early
    for junk in ["", "1", "x.1", "1.x", "1.-2", "1e5.3"]:
        with pytest.raises(ValueError):
            Cursor.decode(junk)


def test_parse_utc():
    assert presenters.parse_utc("2024-05-01T12:30") == datetime(2024, 5, 1, 12, 30, tzinfo=UTC)
    assert presenters.parse_utc("2024-05-01T12:30+02:00") == datetime(
        2024, 5, 1, 10, 30, tzinfo=UTC
    )
    assert presenters.parse_utc(" ") is None
    # Past the ends of the calendar in UTC: a bound before or after every time.
    assert presenters.parse_utc("0001-01-01T00:00+01:00") == datetime.min.replace(tzinfo=UTC)
    assert presenters.parse_utc("9999-12-31T23:59-01:00") == datetime.max.replace(tzinfo=UTC)
    with pytest.raises(ValueError):
        presenters.parse_utc("tomorrow")


@pytest.mark.parametrize(
    ("target", "ok"),
    [
        ("/admin/", True),
        ("/admin", True),
        ("/admin/events?q=1", True),
        ("/administrator", False),
        ("/api/events", False),
        ("https://evil.example/admin/", False),
        ("//evil.example/admin/", False),
        ("/admin\\@evil", False),
        ("/admin/\r\nSet-Cookie: x", False),
        (None, False),
    ],
)
def test_safe_next(target, ok):
    assert safe_next(target) == (target if ok else None)


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (["x" * 1024] * 1024, ["y" * 1024] * 1024),  # 1 MB a side
        (["a"] * (presenters.MAX_DIFF_LINES + 1), ["b"]),  # many short lines
        (["k" * 40_000], ["j" * 40_000]),  # one long line
    ],
    ids=["one-megabyte", "lines", "bytes"],
)
def test_compare_bodies_past_the_bounds_does_not_match_lines(left, right) -> None:
    diff = presenters.compare_bodies(left, right)
    assert not diff.bounded and diff.rows == []
    assert diff.left == "\n".join(left) and diff.right == "\n".join(right)


def test_long_lines_within_the_bounds_are_marked_whole() -> None:
    diff = presenters.compare_bodies(["a " * 400], ["b " * 400])
    assert diff.bounded
    (row,) = diff.rows
    assert row.left == (presenters.Segment("a " * 400, True),)
    assert row.right == (presenters.Segment("b " * 400, True),)
