"""The contract every provider module implements.

A provider knows three things about one kind of sender: how it signs a
delivery, which stable value identifies the logical message across retries
(the dedup key), and where the event type lives. It knows nothing about the
database or Flask: the receipt code hands it an :class:`Inbound` and acts on
what it returns or raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from werkzeug.datastructures import Headers

from ...config import SourceConfig


class ProviderError(Exception):
    """Base class of what a provider raises about a delivery."""


class SignatureError(ProviderError):
    """The delivery is not authentic: missing, malformed or wrong signature (401)."""


class TimestampError(SignatureError):
    """The signed timestamp is outside the tolerance, in either direction (401)."""


class PayloadError(ProviderError):
    """The body cannot be read as this provider's payload (400)."""


class MissingKeyError(PayloadError):
    """No stable dedup key can be found in the delivery (400)."""


@dataclass(frozen=True)
class Inbound:
    """What a provider may look at: the raw bytes, the headers, the parsed JSON."""

    body: bytes
    headers: Headers
    content_type: str
    json: Any  # the parsed body when it is JSON, else None
    now: float  # unix time the request arrived, injected for testability


@dataclass(frozen=True)
class Identified:
    """What a verified delivery is: its dedup key, its type, extra metadata to keep."""

    dedup_key: str
    event_type: str | None
    meta: dict[str, Any] = field(default_factory=dict)
    # When set, the receipt answers with this JSON and stores nothing
    # (Slack's url_verification handshake).
    immediate_response: dict[str, Any] | None = None


@dataclass(frozen=True)
class Part:
    """One event of a batched delivery: what it is, its own JSON, and what its fingerprint covers.

    ``canonical`` is the event as a delivery of it alone would be
    fingerprinted (CloudEvents' canonical form), so the same event sent
    alone and in a batch is one; ``json`` is what is stored.
    """

    identified: Identified
    json: Any
    canonical: Any


class Provider(Protocol):
    """A signature scheme and a dedup rule for one kind of sender."""

    name: str
    requires_json: bool
    # Headers whose values change on every attempt or carry secrets: they are
    # redacted when stored and never part of the fingerprint.
    secret_headers: frozenset[str]

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """Raise SignatureError (or TimestampError) unless the delivery is authentic."""

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """Return the dedup key and event type, or raise PayloadError."""
