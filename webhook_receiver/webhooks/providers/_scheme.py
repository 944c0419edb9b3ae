"""The configurable HMAC scheme of generic and cloudevents sources.

A source describes how its sender signs (``docs/providers.md``), every key
defaulting to the original generic scheme: HMAC-SHA256, hex, of the raw body,
in ``signature_header``, an optional ``<word>=`` prefix. The options are
validated at start-up (``config.signing.check_hmac_scheme``); here they are applied:

- ``algorithm``: sha1, sha256 or sha512;
- ``encoding``: hex or base64, of the digest in the header;
- ``signature_prefix``: stripped from the header value when present;
- ``signed_content``: a template such as ``{timestamp}.{body}``, where
  ``{body}`` is the raw body and ``{timestamp}`` / ``{id}`` the values of
  ``timestamp_header`` / ``id_header`` exactly as sent;
- a signed timestamp (unix seconds, or RFC 3339 as Twitch sends it) must be
  within ``tolerance_seconds`` of now, either way.

Secrets are their UTF-8 bytes; ``base64:<data>`` gives the raw bytes.
"""

from __future__ import annotations

import base64
import hmac
import re
from datetime import UTC, datetime

from ...config import BASE64_SECRET_PREFIX, signed_content_parts
from . import _common as c
from .base import Inbound, SignatureError, SourceConfig

# The original generic scheme's optional label before a hex digest (``sha256=<hex>``).
_ANY_PREFIX = re.compile(r"^[A-Za-z0-9_.-]+=")
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?([Zz]|[+-]\d{2}:\d{2})",
    re.ASCII,
)
# Unix seconds have 10 digits until 2286; far longer is not a time at all.
_MAX_UNIX_DIGITS = 15


def secret_bytes(secret: str) -> bytes:
    """The key a configured secret stands for: ``base64:<data>`` decoded, else its UTF-8."""
    if secret.startswith(BASE64_SECRET_PREFIX):
        return base64.b64decode(secret[len(BASE64_SECRET_PREFIX) :], validate=True)
    return secret.encode()


def signed_at(value: str, name: str) -> int:
    """Parse a signed timestamp: unix seconds, or an RFC 3339 date-time (SignatureError)."""
    if value.isascii() and value.isdigit():
        if len(value) > _MAX_UNIX_DIGITS:
            raise SignatureError(f"malformed {name} header")
        return c.timestamp(value, name)
    match = _RFC3339.fullmatch(value)
    if match is None:
        raise SignatureError(f"malformed {name} header")
    year, month, day, hour, minute, second, _fraction, zone = match.groups()
    try:
        # The fraction is dropped: the tolerance is in whole seconds, and
        # datetime takes no more than microseconds (Twitch sends nanoseconds).
        when = datetime(
            int(year), int(month), int(day), int(hour), int(minute), int(second), tzinfo=UTC
        )
    except ValueError as exc:
        raise SignatureError(f"malformed {name} header") from exc
    if zone not in ("Z", "z"):
        sign = 1 if zone[0] == "+" else -1
        hours, minutes = int(zone[1:3]), int(zone[4:6])
        if hours > 23 or minutes > 59:
            raise SignatureError(f"malformed {name} header")
        return int(when.timestamp()) - sign * (hours * 3600 + minutes * 60)
    return int(when.timestamp())


def _digest(value: str, source: SourceConfig) -> bytes | None:
    """Decode the signature header's value as the source says; None when malformed."""
    prefix = source.extra.get("signature_prefix")
    encoding = source.extra.get("encoding", "hex")
    if prefix is not None:
        value = value.removeprefix(prefix)
    elif encoding == "hex":
        value = _ANY_PREFIX.sub("", value, count=1)
    return c.from_hex(value) if encoding == "hex" else c.from_b64(value)


def signed_message(inbound: Inbound, source: SourceConfig) -> tuple[bytes, int | None]:
    """Build the bytes the sender signed, and the signed time when there is one."""
    parts = signed_content_parts(source.extra.get("signed_content", "{body}"))
    when = None
    message = bytearray()
    for index, part in enumerate(parts):
        if index % 2 == 0:
            message += part.encode()
        elif part == "body":
            message += inbound.body
        elif part == "timestamp":
            name = source.extra["timestamp_header"]
            stamp = c.header(inbound, name)
            when = signed_at(stamp, name)
            message += c.raw(stamp, name)
        else:
            name = source.extra["id_header"]
            message += c.raw(c.header(inbound, name), name)
    return bytes(message), when


def verify(inbound: Inbound, source: SourceConfig) -> None:
    """Check ``source.signature_header`` by the source's scheme against every secret."""
    if not source.signature_header:
        raise SignatureError("no signature header configured")
    value = c.header(inbound, source.signature_header)
    digest = _digest(value, source)
    if digest is None:
        raise SignatureError(f"malformed {source.signature_header} header")
    message, when = signed_message(inbound, source)
    algorithm = source.extra.get("algorithm", "sha256")
    expected = (hmac.digest(secret_bytes(s), message, algorithm) for s in c.secrets_of(source))
    if not c.any_match(expected, [digest]):
        raise SignatureError("signature does not match")
    if when is not None:
        c.check_tolerance(when, inbound, source)
