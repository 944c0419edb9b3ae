from __future__ import annotations

import pytest

from webhook_receiver.webhooks.providers import MissingKeyError, PayloadError
from webhook_receiver.webhooks.providers._common import dedup_key, from_hex, resolve_pointer

# The example document of RFC 6901 section 5.
DOC = {
    "foo": ["bar", "baz"],
    "": 0,
    "a/b": 1,
    "c%d": 2,
    "e^f": 3,
    "g|h": 4,
    "i\\j": 5,
    'k"l': 6,
    " ": 7,
    "m~n": 8,
}


@pytest.mark.parametrize(
    ("pointer", "expected"),
    [
        ("", DOC),
        ("/foo", ["bar", "baz"]),
        ("/foo/0", "bar"),
        ("/", 0),
        ("/a~1b", 1),
        ("/c%d", 2),
        ("/e^f", 3),
        ("/g|h", 4),
        ("/i\\j", 5),
        ('/k"l', 6),
        ("/ ", 7),
        ("/m~0n", 8),
    ],
)
def test_rfc6901_examples(pointer: str, expected: object) -> None:
    assert resolve_pointer(DOC, pointer) == expected


@pytest.mark.parametrize("pointer", ["/foo/2", "/foo/-", "/foo/01", "/nope", "/foo/0/x"])
def test_pointer_to_nothing_is_none(pointer: str) -> None:
    assert resolve_pointer(DOC, pointer) is None


@pytest.mark.parametrize("pointer", ["foo", "/m~2n", "/m~"])
def test_invalid_pointer(pointer: str) -> None:
    with pytest.raises(PayloadError):
        resolve_pointer(DOC, pointer)


def test_dedup_key_limits() -> None:
    assert dedup_key("k" * 512) == "k" * 512
    with pytest.raises(MissingKeyError, match="dedup key too long"):
        dedup_key("k" * 513)
    for empty in ("", "   ", None, 42):
        with pytest.raises(MissingKeyError):
            dedup_key(empty)


def test_from_hex_is_strict() -> None:
    assert from_hex("00ff") == b"\x00\xff"
    assert from_hex("00 ff") is None
    assert from_hex("0ff") is None
    assert from_hex("zz") is None
    assert from_hex("") is None
