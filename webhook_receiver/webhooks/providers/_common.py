"""Helpers the provider modules share: headers, HMAC, timestamps, dedup keys, JSON."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Iterable
from typing import Any

from ... import pointers
from ...fingerprint import JSONError, canonical_number, loads
from ...inbox.messages import KEY_LENGTH
from .base import (
    Inbound,
    MissingKeyError,
    PayloadError,
    SignatureError,
    SourceConfig,
    TimestampError,
)

# The inbox's limit (the events column): a longer key is no usable key.
MAX_KEY_LENGTH = KEY_LENGTH
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")


def header(inbound: Inbound, name: str) -> str:
    """Return the stripped header value, or raise SignatureError when missing or empty."""
    value = (inbound.headers.get(name) or "").strip()
    if not value:
        raise SignatureError(f"missing {name} header")
    return value


def optional_header(inbound: Inbound, name: str) -> str | None:
    """Return the stripped header value, or None when missing or empty."""
    value = (inbound.headers.get(name) or "").strip()
    return value or None


def raw(value: str, name: str) -> bytes:
    """The bytes a header value was sent as (the server decoded them as Latin-1, PEP 3333)."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError as exc:
        raise SignatureError(f"malformed {name} header") from exc


def key_header(inbound: Inbound, name: str) -> str | None:
    """Return the header that carries the dedup key, sent once; None when missing or empty.

    A field sent twice reaches the app joined with a comma (RFC 9110 5.3;
    gunicorn joins them so), and a key that changed with how often a header
    was repeated would let a copy through as new: a second line, or a comma,
    is refused.
    """
    values = inbound.headers.getlist(name)
    if len(values) > 1 or any("," in value for value in values):
        raise PayloadError(f"the {name} header was sent more than once")
    return optional_header(inbound, name)


def secrets_of(source: SourceConfig) -> tuple[str, ...]:
    """Return the source's secrets, refusing to verify against none."""
    if not source.secrets:
        raise SignatureError("no secret configured")
    return source.secrets


def hmac_sha256(key: bytes, message: bytes) -> bytes:
    """Return the raw HMAC-SHA256 digest."""
    # The one-shot C path: hmac.new builds a Python object per call.
    return hmac.digest(key, message, "sha256")


def any_match(expected: Iterable[bytes], given: Iterable[bytes]) -> bool:
    """Whether any given digest equals any expected one, each pair compared in constant time."""
    given = list(given)
    return any(hmac.compare_digest(e, g) for e in expected for g in given)


def same_token(sent: bytes, secret: str) -> bool:
    """Compare a token's bytes as sent with a secret's UTF-8, in constant time, length included."""
    # Hashing first keeps compare_digest from returning early on a length mismatch.
    return hmac.compare_digest(
        hashlib.sha256(sent).digest(), hashlib.sha256(secret.encode()).digest()
    )


def from_hex(value: str) -> bytes | None:
    """Decode hex, or return None when it is not hex."""
    # Stricter than bytes.fromhex, which also skips embedded whitespace.
    if not _HEX.fullmatch(value):
        return None
    return bytes.fromhex(value)


def from_b64(value: str) -> bytes | None:
    """Decode strict base64, or return None when it is not base64."""
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None


# Unix seconds have 10 digits until the year 2286; 12 leave room and keep
# every value inside what int(), datetime and the clock arithmetic can take
# (5000 digits would exceed int()'s limit, 10**400 a float's range).
MAX_TIMESTAMP_DIGITS = 12


def stamped_signatures(
    inbound: Inbound, name: str, separator: str, stamp_label: str, signature_label: str
) -> tuple[str, list[bytes]]:
    """A ``<stamp>=<time><sep><signature>=<hex>...`` header: its one time, and every hex digest.

    The shape Stripe and Paddle share. Other schemes in the header (test
    signatures, ones added later) are ignored, as the senders' SDKs do; an
    undecodable digest is one that cannot match.
    """
    # Each label's values, looked up by the label: a header's other parts are skipped.
    parts: dict[str, list[str]] = {stamp_label: [], signature_label: []}
    for item in header(inbound, name).split(separator):
        label, sep, data = item.strip().partition("=")
        if not sep:
            raise SignatureError(f"malformed {name} header")
        values = parts.get(label)
        if values is not None:
            values.append(data)
    stamps = parts[stamp_label]
    signatures = [d for d in map(from_hex, parts[signature_label]) if d is not None]
    # Unix seconds have 10 digits until 2286: a far longer stamp is not a time.
    if len(stamps) != 1 or len(stamps[0]) > 15:
        raise SignatureError(f"malformed {name} header")
    if not signatures:
        raise SignatureError(f"no {signature_label} signature in {name} header")
    return stamps[0], signatures


def verify_stamped(
    inbound: Inbound,
    source: SourceConfig,
    name: str,
    separator: str,
    stamp_label: str,
    signature_label: str,
    signed_prefix: str,
) -> None:
    """Check a ``stamped_signatures`` header: any digest against every secret, then the time.

    Each secret, as its text (not decoded), keys an HMAC-SHA256 of
    ``signed_prefix`` and the body; the prefix formats ``{stamp}`` as sent
    or ``{signed_at}`` as parsed, whichever the sender signs.
    """
    stamp, signatures = stamped_signatures(inbound, name, separator, stamp_label, signature_label)
    signed_at = timestamp(stamp, name)
    message = signed_prefix.format(stamp=stamp, signed_at=signed_at).encode() + inbound.body
    expected = (hmac_sha256(s.encode(), message) for s in secrets_of(source))
    if not any_match(expected, signatures):
        raise SignatureError("signature does not match")
    check_tolerance(signed_at, inbound, source)


def timestamp(value: str, name: str) -> int:
    """Parse a unix-seconds header, raising SignatureError when malformed."""
    # Digits only: int() would also take signs, spaces and underscores.
    if not value.isascii() or not value.isdigit() or len(value) > MAX_TIMESTAMP_DIGITS:
        raise SignatureError(f"malformed {name} header")
    return int(value)


def check_tolerance(signed_at: int, inbound: Inbound, source: SourceConfig) -> None:
    """Raise TimestampError unless the signed time is within tolerance of now, either way."""
    if abs(inbound.now - signed_at) > source.tolerance_seconds:
        raise TimestampError("timestamp outside the tolerance")


def dedup_key(value: Any, member: str | None = None) -> str:
    """Validate a dedup key: a non-empty string of at most MAX_KEY_LENGTH (512) characters.

    A key holding a lone surrogate (JSON's \\uD800-\\uDFFF escape, valid in
    the body) is no text a database stores: a PayloadError that shows it,
    and names ``member`` where the key came from one.
    """
    if not isinstance(value, str) or not value.strip():
        raise MissingKeyError("no dedup key")
    if len(value) > MAX_KEY_LENGTH:
        raise MissingKeyError("dedup key too long")
    if not value.isascii() and not _is_utf8(value):
        where = f" (from {member})" if member else ""
        shown = escaped_surrogates(value)
        raise PayloadError(
            f'the dedup key{where} "{shown[:80]}" holds a lone surrogate (\\uD800-\\uDFFF): '
            "it cannot be stored as UTF-8 text"
        )
    return value


def escaped_surrogates(text: str) -> str:
    """``text`` with each lone surrogate written as an escape (``\\ud800``), which UTF-8 stores.

    For text that is shown or kept beside the body (a log, the meta), never
    for a key: a backslash already in the text reads the same.
    """
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def pointer_text(value: Any) -> Any:
    """A number a JSON pointer found, as key text (``1``, ``1.0``, ``1e0``: ``"1"``); else as is.

    The same text as the number in canonical JSON (``fingerprint.canonical_number``),
    and as a broker source's ``json:`` key: an id re-serialised as a float
    is the same key. Booleans are not numbers here.
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        return canonical_number(value)
    return value


def json_object(inbound: Inbound) -> dict[str, Any]:
    """Return the parsed body as a JSON object, or raise PayloadError."""
    if not isinstance(inbound.json, dict):
        raise PayloadError("body is not a JSON object")
    return inbound.json


def str_or_none(value: Any) -> str | None:
    """Return a non-empty string as is, anything else as None."""
    return value if isinstance(value, str) and value else None


def parse_json(body: bytes, *, lone_surrogates: bool = False) -> Any:
    """Parse a body the receipt code did not parse, raising PayloadError.

    ``lone_surrogates``: as ``fingerprint.loads`` (accepted, for a provider
    that fingerprints the value by canonical_json and stores the body as sent).
    """
    try:
        return loads(body, lone_surrogates=lone_surrogates)
    except JSONError as exc:
        raise PayloadError(f"body is not valid JSON: {exc}") from exc


def resolve_pointer(document: Any, pointer: str) -> Any:
    """Resolve an RFC 6901 JSON pointer; None when nothing is there (see ``pointers``).

    The one resolution the broker sources and the ordering rules use too;
    a text that is no pointer is a PayloadError here.
    """
    try:
        return pointers.resolve(document, pointer)
    except pointers.PointerError as exc:
        raise PayloadError(str(exc)) from exc
