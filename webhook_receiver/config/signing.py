"""How a source's signing is written: the HMAC scheme's grammar and secrets' forms.

The grammar lives here, in the foundation, because the config is checked at
start-up before any provider is asked; the generic and cloudevents providers
(``webhooks/providers/_scheme.py``) read templates with the same
``signed_content_parts`` and secrets with the same prefix.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from .settings import ConfigError

# The configurable HMAC scheme of generic and cloudevents sources (see
# docs/providers.md); each key's default is today's scheme: HMAC-SHA256, hex,
# of the body, an optional "<word>=" prefix.
HMAC_SCHEME_KEYS = frozenset(
    {"algorithm", "encoding", "signature_prefix", "signed_content", "timestamp_header", "id_header"}
)
HMAC_ALGORITHMS = ("sha1", "sha256", "sha512")
HMAC_ENCODINGS = ("hex", "base64")
# What signed_content may hold besides literal text.
SIGNED_PLACEHOLDERS = ("body", "timestamp", "id")
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
# A secret written "base64:<data>" is these raw bytes; any other is its UTF-8.
BASE64_SECRET_PREFIX = "base64:"


def is_standard_secret(secret: str) -> bool:
    if not secret.startswith("whsec_"):
        return False
    try:
        return bool(base64.b64decode(secret[len("whsec_") :], validate=True))
    except (binascii.Error, ValueError):
        return False


def signed_content_parts(template: str) -> list[str]:
    """Split a signed_content template into literal text and ``{name}`` placeholders (ValueError).

    Odd indexes of the result are placeholder names, even ones literal text.
    """
    parts = _PLACEHOLDER.split(template)
    literals, names = parts[0::2], parts[1::2]
    if any("{" in text or "}" in text for text in literals):
        raise ValueError("a brace outside a {body}, {timestamp} or {id} placeholder")
    unknown = sorted(set(names) - set(SIGNED_PLACEHOLDERS))
    if unknown:
        raise ValueError(f"unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)}")
    if names.count("body") != 1:
        raise ValueError("{body} must appear exactly once")
    if any(names.count(name) > 1 for name in names):
        raise ValueError("a placeholder appears more than once")
    return parts


def check_hmac_scheme(table: dict[str, Any], secrets: list[str], where: str) -> None:
    """Refuse at start-up what the configurable HMAC scheme could not verify."""
    for key, choices in (("algorithm", HMAC_ALGORITHMS), ("encoding", HMAC_ENCODINGS)):
        if key in table and table[key] not in choices:
            raise ConfigError(f"{where} {key} must be one of {', '.join(choices)}")
    for key in ("signature_prefix", "timestamp_header", "id_header"):
        value = table.get(key)
        if key in table and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{where} {key} must be a non-empty string")
    template = table.get("signed_content", "{body}")
    if not isinstance(template, str):
        raise ConfigError(f"{where} signed_content must be a string such as '{{body}}'")
    try:
        names = signed_content_parts(template)[1::2]
    except ValueError as exc:
        raise ConfigError(f"{where} signed_content {template!r}: {exc}") from exc
    # A header the signature does not cover proves nothing, and a placeholder
    # without its header could never be filled: both are mistakes.
    for name, key in (("timestamp", "timestamp_header"), ("id", "id_header")):
        if name in names and key not in table:
            raise ConfigError(
                f"{where} signed_content uses {{{name}}} but {key} is not set: "
                f"name the header that carries the {name}"
            )
        if key in table and name not in names:
            raise ConfigError(
                f"{where} {key} is set but signed_content does not use {{{name}}}: "
                "an unsigned header proves nothing"
            )
    for secret in secrets:
        if secret.startswith(BASE64_SECRET_PREFIX) and not _is_base64(
            secret[len(BASE64_SECRET_PREFIX) :]
        ):
            raise ConfigError(f"{where} a secret written 'base64:...' must be non-empty base64")


def _is_base64(data: str) -> bool:
    try:
        return bool(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError):
        return False
