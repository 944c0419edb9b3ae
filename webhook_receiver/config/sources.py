"""Webhook sources: the ``[sources.<name>]`` tables whose provider is a webhook provider.

Which providers there are is the provider registry's to say
(``webhooks.providers.PROVIDERS``): the app factory hands its names to the
loader, which checks a source's provider before its table is read here.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from typing import Any

from .. import pointers
from .forwards import PROCESSING_KEYS
from .settings import CENTURY_DAYS, YEAR, ConfigError, check_positive_integer
from .signing import HMAC_SCHEME_KEYS, check_hmac_scheme, is_standard_secret

# A source's numbers' largest values, and why: a retention past a century
# put flask purge's cutoff before year 1 (OverflowError).
SOURCE_MAXIMA: dict[str, tuple[int, str]] = {
    "tolerance_seconds": (YEAR, "1 year: a wider window is no check of replays"),
    "retention_days": (CENTURY_DAYS, "a century: its cutoff stays a date"),
}

_SOURCE_KEYS = {
    "provider",
    "secrets",
    "tolerance_seconds",
    "retention_days",
    "signature_header",
    "dedup_key",
    *PROCESSING_KEYS,
}
# What a provider reads beyond the common keys (into SourceConfig.extra).
_PROVIDER_KEYS: dict[str, frozenset[str]] = {
    "generic": frozenset({"event_type"}) | HMAC_SCHEME_KEYS,
    "cloudevents": HMAC_SCHEME_KEYS,
}


@dataclass(frozen=True)
class SourceConfig:
    """One ``[sources.<name>]`` table of the config file, validated."""

    name: str
    provider: str
    secrets: tuple[str, ...] = field(repr=False)
    tolerance_seconds: int = 300
    retention_days: int = 30
    signature_header: str | None = None
    dedup_key: str = "header:Idempotency-Key"
    # Settings only some providers read, each listed in _PROVIDER_KEYS.
    extra: dict[str, Any] = field(default_factory=dict)


def parse_spec(spec: str) -> tuple[str, str]:
    """Split a ``header:<Name>`` or ``json:<pointer>`` spec into kind and argument (ValueError)."""
    kind, sep, arg = spec.partition(":")
    if not sep or kind not in ("header", "json"):
        raise ValueError(f"{spec!r} is not 'header:<Name>' or 'json:<pointer>'")
    if kind == "header" and not arg.strip():
        raise ValueError(f"{spec!r} names no header")
    if kind == "json" and arg and not arg.startswith("/"):
        raise ValueError(f"{spec!r}: a JSON pointer starts with '/'")
    if kind == "json":
        pointers.parse(arg)  # the parser every intake resolves with (a ValueError)
    return kind, arg


def check_source_name(name: str, where: str) -> None:
    """Refuse a source name no URL or event source could carry (webhook and broker alike)."""
    # /webhooks/.. is /webhooks/ to every client; a control character would
    # reach log lines raw.
    if (
        not name.strip()
        or "/" in name
        or name.startswith("api:")
        # An API client's events are api:<client>: a source "api" would share
        # their downstream keys (processing/stable_keys.py).
        or name in (".", "..", "api")
        or any(unicodedata.category(c) == "Cc" for c in name)
    ):
        raise ConfigError(
            f"{where} is not a usable source name (not blank, '.' or '..', "
            "no '/' or control character, not 'api' nor starting 'api:')"
        )


def source_config(name: str, table: dict[str, Any], where: str) -> SourceConfig:
    """Validate a webhook source's table; its name and provider are checked by the loader."""
    provider = table["provider"]
    secrets = table.get("secrets", [])
    if (
        not isinstance(secrets, list)
        or not secrets
        or not all(isinstance(s, str) and s for s in secrets)
    ):
        raise ConfigError(f"{where} secrets must be a non-empty list of strings")
    tolerance = table.get("tolerance_seconds", 300)
    retention = table.get("retention_days", 30)
    for key, value in (("tolerance_seconds", tolerance), ("retention_days", retention)):
        check_positive_integer(value, key, where, SOURCE_MAXIMA)
    signature_header = table.get("signature_header")
    if provider in ("generic", "cloudevents") and (
        not isinstance(signature_header, str) or not signature_header.strip()
    ):
        # A blank name would start, then refuse every delivery.
        raise ConfigError(f"{where} provider {provider} needs signature_header")
    dedup_key = table.get("dedup_key", "header:Idempotency-Key")
    for key in ("dedup_key", "event_type"):
        spec = dedup_key if key == "dedup_key" else table.get(key)
        if spec is None:
            continue
        try:
            parse_spec(spec) if isinstance(spec, str) else parse_spec("")
        except ValueError as exc:
            raise ConfigError(
                f"{where} {key} must be 'header:<Name>' or 'json:<JSON pointer>': {exc}"
            ) from exc
    if provider == "standard":
        for secret in secrets:
            if not is_standard_secret(secret):
                raise ConfigError(f"{where} secrets must be whsec_<base64> for provider standard")
    if provider in ("generic", "cloudevents"):
        check_hmac_scheme(table, secrets, where)
    allowed = _SOURCE_KEYS | _PROVIDER_KEYS.get(provider, frozenset())
    unknown = set(table) - allowed
    if unknown:
        # A typo (tolerence_seconds) must not silently fall back to a default.
        raise ConfigError(
            f"{where} unknown key(s) for provider {provider}: {', '.join(sorted(unknown))}"
        )
    extra = {k: v for k, v in table.items() if k not in _SOURCE_KEYS}
    return SourceConfig(
        name=name,
        provider=provider,
        secrets=tuple(secrets),
        tolerance_seconds=tolerance,
        retention_days=retention,
        signature_header=signature_header,
        dedup_key=dedup_key,
        extra=extra,
    )
