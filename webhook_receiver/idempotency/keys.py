"""Reading the Idempotency-Key header (draft-ietf-httpapi-idempotency-key-header).

The draft makes the value an RFC 8941 sf-string (``"..."``); Stripe and most
clients send a bare token. Both are accepted. A comma outside quotes means
the header was sent twice and joined by the server, which is refused.
"""

from __future__ import annotations

from werkzeug.datastructures import EnvironHeaders, Headers

from ..problems import Problem

HEADER = "Idempotency-Key"
MAX_LENGTH = 255
# The server joins a repeated header with commas, so a comma outside quotes
# may be either: the detail says both.
_COMMA = (
    f"{HEADER} holds a comma outside quotes: send the header once, and a key "
    'with a comma as a quoted string ("...")'
)


def parse_key(headers: Headers, *, required: bool = True) -> str | None:
    """Return the request's Idempotency-Key, or raise the 400 problem."""
    if isinstance(headers, EnvironHeaders):
        # A WSGI environ holds one value per header (the server joins
        # repeats with commas, refused below): a lookup, not getlist's walk
        # over every header of the request.
        value = headers.get(HEADER)
        values = [] if value is None else [value]
    else:
        values = headers.getlist(HEADER)
    if not values:
        if required:
            raise Problem("idempotency-key-missing", f"send an {HEADER} header with this request")
        return None
    if len(values) > 1:
        raise Problem("idempotency-key-invalid", f"{HEADER} was sent more than once")
    raw = values[0].strip(" \t")
    key = _parse_sf_string(raw) if raw.startswith('"') else _parse_bare(raw)
    if not 1 <= len(key) <= MAX_LENGTH:
        raise Problem(
            "idempotency-key-invalid", f"{HEADER} must be 1 to {MAX_LENGTH} characters long"
        )
    return key


def _printable(ch: str) -> bool:
    return " " <= ch <= "~"


def _parse_bare(raw: str) -> str:
    if "," in raw:
        raise Problem("idempotency-key-invalid", _COMMA)
    if not all(_printable(ch) for ch in raw):
        raise Problem("idempotency-key-invalid", f"{HEADER} must be printable ASCII")
    return raw


def _parse_sf_string(raw: str) -> str:
    out: list[str] = []
    i = 1
    while i < len(raw):
        ch = raw[i]
        if ch == "\\":
            if i + 1 >= len(raw) or raw[i + 1] not in '"\\':
                raise Problem("idempotency-key-invalid", "bad escape in quoted Idempotency-Key")
            out.append(raw[i + 1])
            i += 2
            continue
        if ch == '"':
            rest = raw[i + 1 :].strip(" \t")
            if rest.startswith(","):
                raise Problem("idempotency-key-invalid", _COMMA)
            if rest:
                raise Problem(
                    "idempotency-key-invalid", f"{HEADER} has text after the closing quote"
                )
            return "".join(out)
        if not _printable(ch):
            raise Problem("idempotency-key-invalid", f"{HEADER} must be printable ASCII")
        out.append(ch)
        i += 1
    raise Problem("idempotency-key-invalid", "unterminated quoted Idempotency-Key")
