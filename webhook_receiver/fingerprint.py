"""Fingerprints of request content, and the strict JSON reading they rely on.

A fingerprint must not change when a sender re-serialises the same JSON
(key order, whitespace, how a number is written), so JSON bodies are
canonicalised first: sorted keys, no insignificant whitespace, UTF-8, and
numbers as RFC 8785 writes them (ECMAScript's Number-to-string: ``1``,
``1.0`` and ``1e0`` are all ``1``; see :func:`canonical_number`).

One departure from RFC 8785, which reads every number as a double: an
integer written without a fraction or an exponent keeps all its digits,
however large. A 64-bit id rounded to a double would share its text (so
its key and fingerprint) with its neighbours, and two different events
would be one. A number written with a fraction or an exponent is a double,
as in RFC 8785: ``9007199254740993.0`` is ``9007199254740992``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from itertools import accumulate, count, repeat
from operator import lshift, sub
from typing import Any


class JSONError(ValueError):
    """The bytes are not strict JSON (bad UTF-8, syntax, NaN, or nested too deep)."""


class _Refused(JSONError):
    """Raised from inside the parser: its message is already the whole story."""


# Deeper documents are refused. Python's own recursion limit depends on how
# deep the stack already is, so without a fixed bound a document could parse
# in one place and fail to serialise in another (a 500). Payloads are a few
# levels deep; 256 is orjson's limit too.
MAX_DEPTH = 256
# A \uD800-\uDFFF escape is the only way a lone surrogate gets into a string
# (UTF-8 cannot carry one). Seeing the escape is cheap; only then is the
# document checked, where a caller refuses them.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_ONE_BRACKET = bytes.maketrans(b"{}", b"[]")
_NOT_A_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_OPENING_IS_ONE = bytes.maketrans(b"[]", b"\x01\x00")
_PASSES = 8


def _reject_constant(name: str) -> Any:
    raise _Refused(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    # 1e400 parses as inf: it would be stored, then answered as Infinity
    # (not JSON), and every overflowing number would be the same value.
    value = float(text)
    if value in (_INF, -_INF):
        raise _Refused(f"the number {text[:40]} does not fit a double")
    return value


_INF = float("inf")


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # RFC 8259 leaves repeated names undefined and I-JSON (RFC 7493) forbids
    # them: a reader keeping the first would see another document than the
    # one fingerprinted and stored (json keeps the last).
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _Refused(f"the member name {name[:40]!r} appears twice in one object")
            seen.add(name)
    return value


# Built once: json.loads and json.dumps build a new decoder or encoder for
# every call that passes options.
_DECODER = json.JSONDecoder(
    parse_constant=_reject_constant, parse_float=_finite, object_pairs_hook=_unique_members
)
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
# What _ENCODER writes a string with (in C).
_STRING_TEXT: Callable[[str], str] = json.encoder.encode_basestring  # type: ignore[attr-defined]


def loads(body: bytes, *, lone_surrogates: bool = False) -> Any:
    """Parse strict JSON from bytes, refusing what json.loads lets through.

    A lone surrogate (a \\uD800-\\uDFFF escape outside a pair) is valid JSON
    (RFC 8259 section 8.2 leaves its meaning to the reader), but no text a
    database stores or a page shows: refused unless ``lone_surrogates``,
    for an intake that stores the body as it came and fingerprints it by
    canonical_json (which writes one back as its escape). A text field
    derived from one (a key, a type) is refused by Message.build.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONError("body is not valid UTF-8") from exc
    if text.startswith("\ufeff"):
        raise JSONError("body is not valid JSON: a UTF-8 byte order mark comes first")
    try:
        value = _DECODER.decode(text)
    except _Refused as exc:
        raise JSONError(str(exc)) from exc
    except RecursionError as exc:
        raise JSONError("JSON nested too deeply") from exc
    except ValueError as exc:
        raise JSONError(f"body is not valid JSON: {exc}") from exc
    # Nesting cannot exceed the number of brackets: most bodies skip the walk.
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and _too_deep(body):
        raise JSONError(f"JSON nested deeper than {MAX_DEPTH} levels")
    if not lone_surrogates and _SURROGATE_ESCAPE.search(body) and not _is_utf8(value):
        raise JSONError("JSON string holds a lone surrogate (\\uD800-\\uDFFF)")
    return value


def _is_utf8(value: Any) -> bool:
    try:
        _ENCODER.encode(value).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _too_deep(body: bytes) -> bool:
    # On the bytes, at C speed: drop the strings and keep the brackets.
    if b'\\"' in body:
        outside = _STRING.sub(b"", body)
    else:  # no escaped quote: every other piece between quotes is a string
        outside = b"".join(body.split(b'"')[::2])
    skeleton = outside.translate(_ONE_BRACKET, _NOT_A_BRACKET)
    # Each pass strips the innermost pairs, one level; most documents are
    # gone after a few. What remains is measured in one linear pass: the
    # depth after n brackets is 2 * (opening brackets among them) - n.
    for _ in range(_PASSES):
        if not skeleton:
            return False
        skeleton = skeleton.replace(b"[]", b"")
    if not skeleton:
        return False
    opened = accumulate(skeleton.translate(_OPENING_IS_ONE))
    return _PASSES + max(map(sub, map(lshift, opened, repeat(1)), count(1))) > MAX_DEPTH


def is_json_type(content_type: str | None) -> bool:
    """Tell whether a Content-Type names JSON (application/json or any +json)."""
    if not content_type:
        return False
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or mime.endswith("+json")


# Where Python's float repr and ECMAScript's Number-to-string differ, in the
# encoder's output: an integral double below 1e21 ("1.0", "1e+16" where
# ECMAScript writes "1", "10000000000000000") and exponents -5 to -9 ("1e-05",
# "1e-07" where it writes "0.00001", "1e-7"). Elsewhere they agree: both
# write the shortest digits that read back as the same double. Outside a
# string, such text is a number (followed by a delimiter or the end); inside
# one, it only sends the document the longer way, to the same result. Two
# patterns, each led by a literal: a quarter of the time of one with both.
_INTEGRAL_FLOAT = re.compile(r"\.0(?:[,\]}]|$)")
_EXPONENT_TO_REWRITE = re.compile(r"e(?:\+1[6-9]|\+20|-0[5-9])(?:[,\]}]|$)")


def canonical_json(value: Any) -> bytes:
    """Serialise a parsed JSON value canonically, its numbers as RFC 8785 writes them."""
    try:
        text = _ENCODER.encode(value)
        if _INTEGRAL_FLOAT.search(text) or _EXPONENT_TO_REWRITE.search(text):
            # Rare: most bodies hold no float whose repr differs, and the C
            # encoder's text stands (walking every body in Python would cost
            # more than the encoding; RFC 8785's own package took 5 times as long).
            text = "".join(_encode_with_numbers(value, []))
        return text.encode("utf-8")
    except RecursionError as exc:
        raise JSONError("JSON nested too deeply") from exc
    except UnicodeEncodeError:
        # A lone surrogate, the only text UTF-8 cannot encode: written as
        # the escape it came as (\ud800), inside its string, where nothing
        # else can produce that text (a backslash is written \\).
        return text.encode("utf-8", "backslashreplace")


def _encode_with_numbers(value: Any, out: list[str]) -> list[str]:
    # The encoder's output, but each float written by canonical_number.
    kind = type(value)
    if kind is str:
        out.append(_STRING_TEXT(value))
    elif kind is float:
        out.append(canonical_number(value))
    elif kind is dict:
        out.append("{")
        for index, (name, item) in enumerate(sorted(value.items())):
            if index:
                out.append(",")
            out.append(_STRING_TEXT(name))
            out.append(":")
            _encode_with_numbers(item, out)
        out.append("}")
    elif kind is list or kind is tuple:
        out.append("[")
        for index, item in enumerate(value):
            if index:
                out.append(",")
            _encode_with_numbers(item, out)
        out.append("]")
    elif isinstance(value, float):
        out.append(canonical_number(value))
    else:
        out.append(_ENCODER.encode(value))
    return out


def canonical_number(value: int | float) -> str:
    """Write a JSON number as RFC 8785 does: ``1``, ``1.0`` and ``1e0`` all give ``"1"``.

    A float is written by ECMAScript's Number-to-string (RFC 8785 3.2.2.3):
    the shortest digits that read back as the same double, without a
    fraction when it is integral, in exponent form from 1e21 and below
    1e-6 (``1e+21``, ``1e-7``), ``-0`` as ``0``. An int keeps all its digits,
    however large (see the module's docstring). The key text of a number a
    ``json:`` pointer finds, and the numbers of canonical_json.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"not a JSON number: {value!r}")
    if isinstance(value, int):
        return str(value)
    if value != value or value in (_INF, -_INF):
        raise ValueError(f"{value!r} is not a JSON number")
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))  # exact, and the common case: no digits to take apart
    # repr gives the shortest round-trip digits, the ones ECMAScript chooses
    # too; only their layout differs.
    sign, text = ("-", repr(-value)) if value < 0 else ("", repr(value))
    mantissa, _, exponent = text.partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    # The value is 0.<digits> x 10**point.
    point = len(whole) + int(exponent or 0) - (len(whole + fraction) - len(digits))
    digits = digits.rstrip("0")
    k = len(digits)
    if k <= point <= 21:
        body = digits + "0" * (point - k)
    elif 0 < point <= 21:
        body = f"{digits[:point]}.{digits[point:]}"
    elif -6 < point <= 0:
        body = f"0.{'0' * -point}{digits}"
    else:
        power = point - 1
        lead = digits[0] + (f".{digits[1:]}" if k > 1 else "")
        body = f"{lead}e{'+' if power > 0 else '-'}{abs(power)}"
    return sign + body


def fingerprint(parts: Iterable[bytes | str]) -> str:
    """SHA-256 over length-prefixed parts, so that no two part lists collide."""
    digest = hashlib.sha256()
    for part in parts:
        # surrogatepass: a type holding a lone surrogate is refused by
        # Message.build with a 400 that says so, not a 500 here.
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()
