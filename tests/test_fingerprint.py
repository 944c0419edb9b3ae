"""Numbers in canonical JSON and in key text, as RFC 8785 writes them.

`{"id": 1}` and `{"id": 1.0}` are one value: a producer that re-serialises
an id as a float must not make a second event. Floats are written by
ECMAScript's Number-to-string (RFC 8785 3.2.2.3); integers keep all their
digits, however large (the module's one departure, for 64-bit ids).
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from webhook_receiver.fingerprint import canonical_json, canonical_number, fingerprint, loads
from webhook_receiver.webhooks.providers import _common

# Values and their text, from RFC 8785's Appendix B and ECMAScript's rules.
ECMASCRIPT = [
    (0.0, "0"),
    (-0.0, "0"),
    (1.0, "1"),
    (-1.0, "-1"),
    (1.5, "1.5"),
    (0.1, "0.1"),
    (123.456, "123.456"),
    (4.35, "4.35"),
    (0.0001, "0.0001"),
    (0.00001, "0.00001"),
    (0.000001, "0.000001"),
    (1e-7, "1e-7"),
    (1.5e-9, "1.5e-9"),
    (1e-10, "1e-10"),
    (5e-324, "5e-324"),
    (9007199254740992.0, "9007199254740992"),
    (1e16, "10000000000000000"),
    (1e20, "100000000000000000000"),
    (1.2345678901234568e20, "123456789012345680000"),
    (1e21, "1e+21"),
    (1.5e300, "1.5e+300"),
    (1.7976931348623157e308, "1.7976931348623157e+308"),
    (-1.7976931348623157e308, "-1.7976931348623157e+308"),
    (333333333.3333333, "333333333.3333333"),
    (1e23, "1e+23"),
    (295147905179352830000.0, "295147905179352830000"),
]


@pytest.mark.parametrize(("value", "text"), ECMASCRIPT)
def test_floats_are_written_as_ecmascript_writes_them(value, text):
    assert canonical_number(value) == text
    assert canonical_json(value) == text.encode()
    assert canonical_json({"n": [value]}) == b'{"n":[' + text.encode() + b"]}"


def test_one_two_and_one_e0_are_one_fingerprint_and_one_key_text():
    bodies = [b'{"id":1}', b'{"id": 1.0}', b'{"id":1e0}', b'{"id":10E-1}', b'{"id":1.000}']
    contents = {canonical_json(loads(body)) for body in bodies}
    assert contents == {b'{"id":1}'}
    assert len({fingerprint(["t", canonical_json(loads(body))]) for body in bodies}) == 1
    assert {canonical_number(loads(body)["id"]) for body in bodies} == {"1"}
    assert {_common.pointer_text(loads(body)["id"]) for body in bodies} == {"1"}


def test_integers_keep_every_digit():
    # RFC 8785 would round 2**53 + 1 to a double: two 64-bit ids would be one key.
    assert canonical_number(2**53 + 1) == "9007199254740993"
    assert canonical_number(2**64) == "18446744073709551616"
    assert canonical_json(loads(b"[9007199254740993, 9007199254740993.0]")) == (
        b"[9007199254740993,9007199254740992]"
    )
    assert canonical_json(loads(b"-0")) == b"0"


def test_numbers_in_strings_are_left_alone():
    # Text that looks like a float the encoder writes differently, inside strings.
    value = {"a": "1.0,", "b": "2e-05]", "c": "v1.0}", "d": 2.5, "e": "1e+20"}
    plain = json.dumps(value, sort_keys=True, separators=(",", ":"))
    assert canonical_json(value) == plain.encode()
    value["f"] = 1.0
    assert canonical_json(value) == (
        b'{"a":"1.0,","b":"2e-05]","c":"v1.0}","d":2.5,"e":"1e+20","f":1}'
    )


def test_the_longer_way_keeps_everything_else_as_the_encoder_writes_it():
    # Key order, escapes and non-ASCII text are the same whichever way is taken.
    body = '{"z":1.0,"é":["\\u0000\\n\\"\\\\😀",true,null,{"b":2,"a":-0.0}],"A":{}}'
    value = loads(body.encode())
    assert canonical_json(value) == (
        '{"A":{},"z":1,"é":["\\u0000\\n\\"\\\\😀",true,null,{"a":0,"b":2}]}'.encode()
    )


@pytest.mark.parametrize("value", [True, None, "1", [1], math.inf, math.nan])
def test_only_finite_numbers_have_a_number_text(value):
    with pytest.raises((TypeError, ValueError)):
        canonical_number(value)


def test_pointer_text_leaves_what_is_not_a_number():
    assert _common.pointer_text(True) is True
    assert _common.pointer_text("1.0") == "1.0"
    assert _common.pointer_text(None) is None


# -- properties -----------------------------------------------------------------

SAFE = 2**53
integral = st.integers(min_value=-SAFE, max_value=SAFE)


@given(integral)
def test_a_float_that_equals_an_int_is_that_int(n):
    as_float = float(n)
    assert canonical_number(as_float) == canonical_number(n) == str(n)
    for written in (f"{n}.0", f"{n}e0", repr(as_float)):
        assert canonical_json(loads(b'{"id":' + written.encode() + b"}")) == (
            b'{"id":' + str(n).encode() + b"}"
        )


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_every_float_reads_back_as_itself(value):
    text = canonical_number(value)
    assert float(text) == value
    assert json.loads(canonical_json([value]), parse_int=float) == [value]
    # ECMAScript's layout: an integer below 1e21 has no fraction and no exponent.
    if value.is_integer() and abs(value) < 1e21:
        assert text.lstrip("-").isdigit()
    # Exponent form only from 1e21 and below 1e-6, without a leading zero.
    if "e" in text:
        assert abs(value) >= 1e21 or abs(value) < 1e-6
        assert not text.split("e")[1].lstrip("+-").startswith("0")


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_the_text_is_the_shortest_that_reads_back(value):
    # As ECMAScript: the digits are repr's (the shortest round trip), only laid out anew.
    digits = canonical_number(value).lstrip("-").split("e")[0].replace(".", "").strip("0")
    expected = repr(abs(value)).split("e")[0].replace(".", "").strip("0")
    assert digits == expected
