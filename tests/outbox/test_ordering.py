"""The ordering record: versions that compare, and the key a rule reads from a body."""

from __future__ import annotations

from webhook_receiver.outbox import ordering


def test_numeric_versions_compare_as_numbers_and_strings_as_strings():
    assert ordering.sortable(9) < ordering.sortable(10)
    assert ordering.sortable("9") < ordering.sortable("10")
    assert ordering.sortable(1.5) < ordering.sortable(2)
    assert ordering.sortable("2024-01-02T00:00:00Z") > ordering.sortable("2024-01-01T23:59:59Z")
    assert ordering.sortable(-2) < ordering.sortable(-1) < ordering.sortable(0)
    assert ordering.sortable(True) is None
    assert ordering.sortable(None) is None


def test_key_for_reads_the_pointers():
    body = b'{"data": {"object": {"id": "a/b", "version": 3}}}'
    key = ordering.key_for("billing", body, "/data/object/version", "/data/object/id")
    assert key == ordering.Key("billing:a/b", ordering.sortable(3))
    assert ordering.key_for("billing", b"not json", "/v", "/id") is None
    assert ordering.key_for("billing", b'{"v": 1}', "/v", "/id") is None
