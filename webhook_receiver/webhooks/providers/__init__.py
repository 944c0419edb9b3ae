"""The provider registry: one instance per provider name, and the contract re-exported.

Two things vary per source rather than per provider, so the receipt code
should ask :func:`needs_json` and :func:`redacted_headers` (which take the
source) rather than read ``requires_json`` / ``secret_headers`` directly:
generic sources need JSON only for a ``json:`` dedup key, and the generic and
cloudevents signature header is whatever ``source.signature_header`` names.
"""

from __future__ import annotations

from typing import Any

from werkzeug.datastructures import Headers

from .base import (
    Identified,
    Inbound,
    MissingKeyError,
    Part,
    PayloadError,
    Provider,
    ProviderError,
    SignatureError,
    SourceConfig,
    TimestampError,
)
from .cloudevents import CloudEventsProvider
from .generic import GenericProvider
from .github import GitHubProvider
from .gitlab import GitLabProvider
from .paddle import PaddleProvider
from .shopify import ShopifyProvider
from .slack import SlackProvider
from .standard import StandardProvider
from .stripe import StripeProvider

# The one list of webhook providers: a source may name only these (the app
# factory hands their names to the config's loader).
PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        StripeProvider(),
        GitHubProvider(),
        StandardProvider(),
        GitLabProvider(),
        ShopifyProvider(),
        SlackProvider(),
        CloudEventsProvider(),
        GenericProvider(),
        PaddleProvider(),
    )
}


def get_provider(name: str) -> Provider:
    """Return the provider registered under ``name``, or raise KeyError."""
    try:
        return PROVIDERS[name]
    except KeyError:
        raise KeyError(f"unknown provider {name!r}") from None


def needs_json(source: SourceConfig) -> bool:
    """Whether deliveries to this source must have a JSON body (else 400 before identify)."""
    provider = get_provider(source.provider)
    per_source = getattr(provider, "requires_json_for", None)
    return bool(per_source(source)) if per_source else provider.requires_json


def decoded(inbound: Inbound, source: SourceConfig) -> Inbound:
    """Return a verified delivery with its payload read from the body, where the provider knows how.

    GitHub's form deliveries carry their JSON in a field: the result's ``json``
    is that JSON, and the receipt fingerprints it as it would a JSON body. The
    raw body is what is stored, whatever its form. Raises PayloadError.
    """
    decode = getattr(get_provider(source.provider), "decode", None)
    return decode(inbound, source) if decode else inbound


def parts(inbound: Inbound, source: SourceConfig) -> list[Part] | None:
    """Return each event of a batched delivery; None when the delivery is not a batch.

    Only CloudEvents batches (``application/cloudevents-batch+json``). Raises
    PayloadError (or MissingKeyError) for a batch that cannot be stored whole.
    """
    split = getattr(get_provider(source.provider), "parts", None)
    return split(inbound, source) if split else None


def handshake(source: SourceConfig, headers: Headers) -> dict[str, str] | None:
    """Return the headers answering a provider's OPTIONS handshake; None when it is not one.

    Only CloudEvents has one (the webhook validation request). Raises
    PayloadError when the request is one but cannot be answered.
    """
    answer = getattr(get_provider(source.provider), "handshake", None)
    return answer(headers, source) if answer else None


def fingerprinted(document: Any, source: SourceConfig) -> Any:
    """The part of a verified JSON delivery its fingerprint covers.

    Top-level members a provider rewrites on each attempt (its
    ``volatile_members``, such as Stripe's ``pending_webhooks``) are left
    out, so that a retry is a duplicate rather than a conflict; the body
    is stored as sent.
    """
    provider = get_provider(source.provider)
    volatile: frozenset[str] = getattr(provider, "volatile_members", frozenset())
    if volatile and isinstance(document, dict) and not volatile.isdisjoint(document):
        # Canonical JSON sorts the members: the order they are kept in is no matter.
        return {name: document[name] for name in document.keys() - volatile}
    return document


def redacted_headers(source: SourceConfig) -> frozenset[str]:
    """Lower-case names of the headers to redact and keep out of the fingerprint for a source."""
    names = get_provider(source.provider).secret_headers
    if source.signature_header:
        names = names | {source.signature_header.lower()}
    # A signed timestamp changes on every attempt, as Slack's and Stripe's do.
    stamp = source.extra.get("timestamp_header")
    if isinstance(stamp, str):
        names = names | {stamp.lower()}
    return names


__all__ = [
    "PROVIDERS",
    "CloudEventsProvider",
    "GenericProvider",
    "GitHubProvider",
    "GitLabProvider",
    "Identified",
    "Inbound",
    "MissingKeyError",
    "PaddleProvider",
    "PayloadError",
    "Part",
    "Provider",
    "ProviderError",
    "ShopifyProvider",
    "SignatureError",
    "SlackProvider",
    "SourceConfig",
    "StandardProvider",
    "StripeProvider",
    "TimestampError",
    "decoded",
    "fingerprinted",
    "get_provider",
    "handshake",
    "needs_json",
    "parts",
    "redacted_headers",
]
