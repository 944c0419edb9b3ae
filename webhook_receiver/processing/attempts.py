"""The worker's side of the attempt log: timing an attempt, and what it keeps of the answer.

The worker opens :class:`Notes` when an attempt starts, a forward adds what
the consumer answered, and :func:`of` makes the attempt's row, which the
worker writes with the outcome (``outbox.attempts``: in the transaction
that records it, or, on PostgreSQL, in its one statement).

A response body is kept up to its first 2 KB, as text, with what looks
like a credential replaced by ``[redacted]``: the forward's own secrets
(signing secrets, the URL's password, user token and query values) wherever
they appear, ``Bearer``/``Basic`` credentials, and the values of JSON
members, form fields and header-like lines whose names say secret (the
names the intakes redact in headers: token, secret, password, api key, ...).
The error is redacted the same way: it quotes the answer too.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import parse_qsl, unquote, urlsplit

from ..config import ForwardConfig
from ..events import REDACTED, SECRET_NAME
from ..outbox.attempts import (
    DELIVERED,
    MAX_RESPONSE_BODY,
    PERMANENT_FAILURE,
    RETRYABLE_FAILURE,
    SKIPPED,
    Attempt,
)
from ..outbox.deliveries import Claim

__all__ = [
    "DELIVERED",
    "PERMANENT_FAILURE",
    "RETRYABLE_FAILURE",
    "SKIPPED",
    "Notes",
    "of",
    "redact",
    "response_text",
]

# "Bearer abc", "Basic abc==", "token abc" (GitHub's) in any text.
_SCHEME_CREDENTIAL = re.compile(r"\b(Bearer|Basic|Token)(\s+)[A-Za-z0-9._~+/=-]{4,}", re.I)
# "name": "value" (JSON), name=value (forms, queries), name: value (headers):
# the value goes when the name says secret.
_JSON_MEMBER = re.compile(r'"([^"\\]{1,100})"(\s*:\s*)"((?:[^"\\]|\\.)*)"')
_PAIR = re.compile(r"(?<![\w-])([A-Za-z][\w.-]{0,99})(\s*[=:]\s*)([^\s&,;\"'<>]+)")


@dataclass
class Notes:
    """What the worker learns about one attempt while it runs."""

    started_at: datetime
    started: float  # time.monotonic() at the start
    response_body: str | None = None
    confirmation: str | None = None

    @classmethod
    def begin(cls, now: datetime) -> Notes:
        """Start timing an attempt that starts ``now``."""
        return cls(started_at=now, started=time.monotonic())


def of(
    claim: Claim,
    notes: Notes | None,
    now: datetime,
    outcome: str,
    *,
    status: int | None = None,
    error: str | None = None,
    worker: str | None = None,
) -> Attempt:
    """The attempt's row, ending ``now``, as the worker writes it (``outbox.attempts``)."""
    if notes is None:
        notes = Notes(started_at=now, started=time.monotonic())
    return Attempt(
        delivery_id=claim.id,
        number=claim.attempt,
        started_at=min(notes.started_at, now),
        ended_at=now,
        outcome=outcome,
        latency_ms=(time.monotonic() - notes.started) * 1000,
        status=status,
        confirmation=notes.confirmation,
        error=None if error is None else redact(error),
        response_body=notes.response_body,
        worker=worker,
    )


def response_text(body: bytes, forward: ForwardConfig) -> str:
    """The first 2 KB of a response body as text, credentials redacted.

    Redacted before it is cut, so that a secret cut in two at 2 KB (a JSON
    string without its closing quote) is still found.
    """
    text = body[: 4 * MAX_RESPONSE_BODY].decode("utf-8", "replace")
    return redact(text, forward)[:MAX_RESPONSE_BODY]


def redact(text: str, forward: ForwardConfig | None = None) -> str:
    """Replace what looks like a credential in ``text`` (see the module's docstring)."""
    for secret in _secrets_of(forward):
        text = text.replace(secret, REDACTED)
    text = _SCHEME_CREDENTIAL.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _JSON_MEMBER.sub(_json_member, text)
    return _PAIR.sub(_pair, text)


def _json_member(match: re.Match[str]) -> str:
    name, sep, value = match.groups()
    if SECRET_NAME.search(name) and value != REDACTED:
        value = REDACTED
    return f'"{name}"{sep}"{value}"'


def _pair(match: re.Match[str]) -> str:
    name, sep, value = match.groups()
    if SECRET_NAME.search(name) and not value.startswith(REDACTED):
        value = REDACTED
    return f"{name}{sep}{value}"


def _secrets_of(forward: ForwardConfig | None) -> list[str]:
    """The forward's own secrets as they could come back in an answer, longest first."""
    if forward is None:
        return []
    found = set(forward.signing_secrets)
    found.update(value for name, value in forward.client_settings if "password" in name and value)
    try:
        parts = urlsplit(forward.url)
        if parts.password:
            found.update({parts.password, unquote(parts.password)})
        elif parts.username:
            found.update({parts.username, unquote(parts.username)})
        found.update(value for _, value in parse_qsl(parts.query) if value)
    except ValueError:
        pass
    # Short values (a query's "1", "json") would blank ordinary words.
    return sorted((s for s in found if len(s) >= 6), key=len, reverse=True)
