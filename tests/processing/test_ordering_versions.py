"""Ordering by entity version: versions that are timestamps or negative numbers."""

from __future__ import annotations

import pytest

from webhook_receiver.outbox import ordering

from .conftest import FAST, config_with, delivery, drain, forward, store_event


def _event(app, clock, key, version):
    return store_event(
        app, clock, dedup_key=key, data={"object": {"id": "cus_1", "version": version}}
    )


# Each pair: an older version, then a newer one that must be applied after it.
NEWER_AFTER_OLDER = [
    # Go's RFC3339Nano and others drop a fraction's trailing zeros: '.' sorts before 'Z'.
    ("2026-12-06T10:00:05Z", "2026-12-06T10:00:05.5Z"),
    ("2026-12-06T10:00:05.1Z", "2026-12-06T10:00:05.12Z"),
    # One instant's offsets differ between producers (or daylight saving time).
    ("2026-12-06T10:30:00Z", "2026-12-06T12:45:00+02:00"),
    ("0999-12-31T23:59:59Z", "1000-01-01T00:00:00+00:00"),
    ("2026-12-06T11:00:00+01:00", "2026-12-06T10:30:00Z"),
    ("2026-12-06T10:00:00.999999999-00:30", "2026-12-06T10:30:01+00:00"),
    (-3, -1),
    (-1.5, 0),
    (-1, 2),
    (-0.000000002, -0.000000001),
    (-(10**23) - 1, -(10**23)),
    (10**23, 10**23 + 1),
    ("99999999999999999999.5", "99999999999999999999.500000001"),
]


@pytest.mark.parametrize(("older", "newer"), NEWER_AFTER_OLDER)
def test_versions_compare_as_what_they_are(older, newer):
    # Their encodings' string order is the database's comparison.
    encoded_older, encoded_newer = ordering.sortable(older), ordering.sortable(newer)
    assert encoded_older is not None and encoded_newer is not None
    assert encoded_older < encoded_newer
    assert len(encoded_older) <= 100 and len(encoded_newer) <= 100


def test_zero_is_zero_whatever_its_sign():
    assert ordering.sortable(-0.0) == ordering.sortable(-1e-12) == ordering.sortable(0)


def test_one_instant_in_two_offsets_is_one_version():
    assert ordering.sortable("2026-12-06T12:00:00+02:00") == ordering.sortable(
        "2026-12-06T10:00:00.000Z"
    )


@pytest.mark.parametrize(("older", "newer"), NEWER_AFTER_OLDER[:6] + NEWER_AFTER_OLDER[6:7])
def test_a_newer_timestamp_is_delivered_not_skipped(
    make_app, downstream, clock, make_worker, older, newer
):
    # Before: the newer version's string sorted below the older one's, so it
    # was skipped as stale and never reached the downstream.
    app = make_app(
        config_with([forward("billing", downstream.url + "/billing")], ordered=True), **FAST
    )
    worker = make_worker(app, clock)
    _event(app, clock, "evt-old", older)
    assert drain(app, worker) == ["delivered"]
    later = _event(app, clock, "evt-new", newer)
    assert drain(app, worker) == ["delivered"]
    assert delivery(app, later, "billing")["state"] == "delivered"
    # And the older one, delivered again later, is now the stale one.
    again = _event(app, clock, "evt-old-again", older)
    assert drain(app, worker) == ["skipped"]
    assert delivery(app, again, "billing")["state"] == "skipped"


@pytest.mark.parametrize(
    "version",
    [
        "2026-12-06T10:00:00",
        "2026-13-06T10:00:00Z",
        "2026-12-06T24:00:00Z",
        "0001-01-01T00:00:00+01:00",
    ],
)
def test_a_timestamp_without_offset_or_not_a_date_still_compares_as_a_string(version):
    assert ordering.sortable(version) == "s" + version
