"""Fingerprints of request content, and the strict JSON reading they rely on.

A fingerprint must not change when a sender re-serialises the same JSON
(key order, whitespace), so JSON bodies are canonicalised first: sorted
keys, no insignificant whitespace, UTF-8.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
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
# (UTF-8 cannot carry one), and a lone surrogate can be neither re-encoded nor
# stored. Seeing the escape is cheap; only then is the document checked.
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


def loads(body: bytes) -> Any:
    """Parse strict JSON from bytes, refusing what json.loads lets through."""
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
    if _SURROGATE_ESCAPE.search(body):
        canonical_json(value)  # raises JSONError on a lone surrogate
    return value


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


def canonical_json(value: Any) -> bytes:
    """Serialise a parsed JSON value canonically."""
    try:
        return _ENCODER.encode(value).encode("utf-8")
    except RecursionError as exc:
        raise JSONError("JSON nested too deeply") from exc
    except UnicodeEncodeError as exc:
        raise JSONError("JSON string holds a lone surrogate (\\uD800-\\uDFFF)") from exc


def fingerprint(parts: Iterable[bytes | str]) -> str:
    """SHA-256 over length-prefixed parts, so that no two part lists collide."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()
