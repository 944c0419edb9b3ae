"""Fingerprints of request content, and the strict JSON reading they rely on.

A fingerprint must not change when a sender re-serialises the same JSON
(key order, whitespace), so JSON bodies are canonicalised first: sorted
keys, no insignificant whitespace, UTF-8.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from .problems import Problem


class JSONError(ValueError):
    """The bytes are not strict JSON (bad UTF-8, syntax, NaN, or nested too deep)."""


def _reject_constant(name: str) -> Any:
    raise JSONError(f"{name} is not valid JSON")


def loads(body: bytes) -> Any:
    """Parse strict JSON from bytes, refusing what json.loads lets through."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONError("body is not valid UTF-8") from exc
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise JSONError("JSON nested too deeply") from exc
    except ValueError as exc:
        raise JSONError(f"body is not valid JSON: {exc}") from exc


def parse_json_body(body: bytes) -> Any:
    """Parse a request's JSON body or raise the 400 problem."""
    try:
        return loads(body)
    except JSONError as exc:
        raise Problem("invalid-json", str(exc)) from exc


def is_json_type(content_type: str | None) -> bool:
    """Tell whether a Content-Type names JSON (application/json or any +json)."""
    if not content_type:
        return False
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or mime.endswith("+json")


def canonical_json(value: Any) -> bytes:
    """Serialise a parsed JSON value canonically."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
            "utf-8"
        )
    except RecursionError as exc:
        raise JSONError("JSON nested too deeply") from exc


def canonical_body(body: bytes, parsed: Any = None, *, is_json: bool = False) -> bytes:
    """Return the bytes a fingerprint covers: canonical JSON when it is JSON, else the raw body."""
    if is_json:
        return canonical_json(parsed)
    return body


def fingerprint(parts: Iterable[bytes | str]) -> str:
    """SHA-256 over length-prefixed parts, so that no two part lists collide."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()
