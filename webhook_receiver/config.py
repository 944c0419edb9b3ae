"""Configuration: defaults, then the environment, then the TOML file.

Plain settings come from the environment (``DATABASE_URL``, ``SECRET_KEY``
and ``WEBHOOK_RECEIVER_*``, read by Flask's ``from_prefixed_env``). The TOML
file at ``WEBHOOK_RECEIVER_CONFIG`` declares who may talk to us: API clients
(``[clients.*]``), provider sources (``[sources.*]``) and handler modules.
"""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The providers a source may name; webhooks.providers registers one
# implementation for each, and checks at import that the two lists agree.
PROVIDER_NAMES = frozenset(
    {
        "stripe",
        "github",
        "gitlab",
        "standard",
        "shopify",
        "slack",
        "cloudevents",
        "generic",
        "paddle",
    }
)
# Stripe and Standard Webhooks retry for about three days; operators replay
# dead letters later still. Markers kept for less let duplicates back in.
MIN_RETENTION_DAYS = 3

DEFAULTS: dict[str, Any] = {
    "MAX_BODY_BYTES": 1024 * 1024,
    "IDEMPOTENCY_LEASE_SECONDS": 60,
    "IDEMPOTENCY_TTL_SECONDS": 24 * 3600,
    # How long a request waits for another's uncommitted claim of its key
    # (PostgreSQL's lock_timeout) before answering 409.
    "IDEMPOTENCY_LOCK_TIMEOUT_SECONDS": 5.0,
    "PURGE_BATCH_SIZE": 1000,
    # Days events are kept when no [sources.*] table says: API events
    # (``api:<client>``), and events of a source since removed from the file.
    "API_RETENTION_DAYS": 30,
    "DEFAULT_RETENTION_DAYS": 30,
    # json or text; unset means json, or text when debugging.
    "LOG_FORMAT": None,
    "LOG_LEVEL": "INFO",
    "ADMIN_PASSWORD": None,
    "METRICS_TOKEN": None,
    "SESSION_COOKIE_SECURE": False,
    # How many reverse proxies in front set X-Forwarded-For/-Proto; 0 trusts
    # none. Login throttling and logs use the client address they give.
    "TRUSTED_PROXIES": 0,
    # Connections go through pgbouncer in transaction mode (see docs/scaling.md).
    "TRANSACTION_POOLER": False,
    # The admin's knobs.
    "ADMIN_SESSION_HOURS": 12,
    "ADMIN_LOGIN_MAX_FAILURES": 5,
    "ADMIN_LOGIN_WINDOW_SECONDS": 900,
    "ADMIN_PAGE_SIZE": 50,
    "FORCE_SHORT_RETENTION": False,
    # Redeliveries' counts and times are written in batches this often (see
    # duplicates.py); 0 writes each in its own request.
    "DUPLICATE_FLUSH_SECONDS": 1.0,
    # Refused deliveries are counted per source, reason, address and minute,
    # and written this often (see rejections.py); 0 writes each at once.
    "REJECTION_FLUSH_SECONDS": 1.0,
    "SQLALCHEMY_ENGINE_OPTIONS": {},
    # The delivery worker (webhook_receiver.processing). A lease must outlast
    # the slowest forward: connect and read timeouts both count.
    "WORKER_LEASE_SECONDS": 60,
    "WORKER_POLL_SECONDS": 1.0,
    "WORKER_MAX_ATTEMPTS": 8,
    "WORKER_BACKOFF_BASE_SECONDS": 30,
    "WORKER_BACKOFF_MAX_SECONDS": 3600,
    "WORKER_RETRY_AFTER_MAX_SECONDS": 24 * 3600,
}

# A placeholder that must never reach production.
DEV_SECRET_KEY = "dev-insecure-secret-key"


class ConfigError(Exception):
    """The configuration cannot be used; the message names what and where."""


# Numeric settings: (type, smallest allowed value).
NUMERIC_SETTINGS: dict[str, tuple[type, float]] = {
    "MAX_BODY_BYTES": (int, 1),
    "IDEMPOTENCY_LEASE_SECONDS": (int, 1),
    "IDEMPOTENCY_TTL_SECONDS": (int, 1),
    "IDEMPOTENCY_LOCK_TIMEOUT_SECONDS": (float, 0.001),
    "PURGE_BATCH_SIZE": (int, 1),
    "API_RETENTION_DAYS": (int, 1),
    "DEFAULT_RETENTION_DAYS": (int, 1),
    "TRUSTED_PROXIES": (int, 0),
    "ADMIN_SESSION_HOURS": (float, 0.01),
    "ADMIN_LOGIN_MAX_FAILURES": (int, 1),
    "ADMIN_LOGIN_WINDOW_SECONDS": (int, 1),
    "ADMIN_PAGE_SIZE": (int, 1),
    "DUPLICATE_FLUSH_SECONDS": (float, 0),
    "REJECTION_FLUSH_SECONDS": (float, 0),
    "WORKER_LEASE_SECONDS": (float, 0.1),
    "WORKER_POLL_SECONDS": (float, 0.001),
    "WORKER_MAX_ATTEMPTS": (int, 1),
    "WORKER_BACKOFF_BASE_SECONDS": (float, 0),
    "WORKER_BACKOFF_MAX_SECONDS": (float, 0),
    "WORKER_RETRY_AFTER_MAX_SECONDS": (float, 0),
}


def check_settings(config: dict[str, Any]) -> None:
    """Coerce the numeric settings in place, or say which one is wrong and how."""
    for name, (kind, smallest) in NUMERIC_SETTINGS.items():
        if name not in config:
            continue
        value = config[name]
        try:
            if isinstance(value, bool):
                raise ValueError
            number = kind(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"WEBHOOK_RECEIVER_{name} must be a{'n integer' if kind is int else ' number'}, "
                f"got {value!r}"
            ) from None
        if number < smallest:
            raise ConfigError(f"WEBHOOK_RECEIVER_{name} must be at least {smallest}, got {value!r}")
        config[name] = number


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
    return kind, arg


@dataclass(frozen=True)
class ClientConfig:
    """One ``[clients.<name>]`` table: an API client and its bearer token."""

    name: str
    token: str = field(repr=False)


@dataclass(frozen=True)
class ForwardConfig:
    """One ``[[sources.<name>.forward]]`` (or ``[[clients.<name>.forward]]``) table."""

    name: str
    url: str
    timeout_seconds: float = 10
    # None forwards every event type.
    event_types: tuple[str, ...] | None = None
    max_attempts: int | None = None


@dataclass(frozen=True)
class OrderingConfig:
    """A source's ``version`` and ``entity`` JSON pointers: stale events are skipped."""

    version: str
    entity: str


@dataclass(frozen=True)
class FileConfig:
    """The validated contents of the TOML file."""

    path: str
    clients: dict[str, ClientConfig] = field(default_factory=dict)
    sources: dict[str, SourceConfig] = field(default_factory=dict)
    handlers: tuple[str, ...] = ()
    # Keyed by event source: a source name, or ``api:<client>``.
    forwards: dict[str, tuple[ForwardConfig, ...]] = field(default_factory=dict)
    ordering: dict[str, OrderingConfig] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def client_for_token(self, token: str) -> ClientConfig | None:
        """Find the client whose token this is, without a timing leak on the token."""
        return self._by_token_digest.get(hashlib.sha256(token.encode()).digest())

    @property
    def _by_token_digest(self) -> dict[bytes, ClientConfig]:
        # Looking up the token's SHA-256 rather than the token means timing
        # reveals nothing about a valid token's characters.
        cached = self.__dict__.get("_token_index")
        if cached is None:
            cached = {hashlib.sha256(c.token.encode()).digest(): c for c in self.clients.values()}
            object.__setattr__(self, "_token_index", cached)
        return cached


def database_uri(url: str | None, instance_path: str) -> str:
    """Turn ``DATABASE_URL`` into a SQLAlchemy URI; default to SQLite in the instance folder."""
    if not url:
        return "sqlite:///" + os.path.join(instance_path, "webhook_receiver.sqlite3")
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def load_file(path: str | os.PathLike[str], *, required: bool) -> FileConfig:
    """Read and validate the TOML file; a missing optional file is an empty config."""
    path = str(path)
    if not Path(path).exists():
        if required:
            raise ConfigError(f"{path}: config file not found")
        return FileConfig(path=path)
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc}") from exc
    return parse(raw, path)


def parse(raw: dict[str, Any], path: str = "<config>") -> FileConfig:
    """Validate a config mapping (the TOML file's contents, or a test's dict)."""
    unknown = set(raw) - {"clients", "sources", "handlers"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s): {', '.join(sorted(unknown))}")
    client_tables = _tables(raw, "clients", path)
    clients = {name: _client(name, table, path) for name, table in client_tables.items()}
    tokens = [c.token for c in clients.values()]
    if len(set(tokens)) != len(tokens):
        raise ConfigError(f"{path}: two clients share one token")
    source_tables = _tables(raw, "sources", path)
    sources = {name: _source(name, table, path) for name, table in source_tables.items()}
    forwards: dict[str, tuple[ForwardConfig, ...]] = {}
    ordering: dict[str, OrderingConfig] = {}
    for kind, tables, prefix in (
        ("clients", client_tables, "api:"),
        ("sources", source_tables, ""),
    ):
        for name, table in tables.items():
            where = f"{path}: [{kind}.{name}]"
            if "forward" in table:
                forwards[prefix + name] = _forwards(
                    table["forward"], f"{path}: [[{kind}.{name}.forward]]"
                )
            order = _ordering(table, where)
            if order is not None:
                ordering[prefix + name] = order
    handlers = raw.get("handlers", [])
    if not isinstance(handlers, list) or not all(isinstance(h, str) for h in handlers):
        raise ConfigError(f"{path}: handlers must be a list of module names")
    return FileConfig(
        path=path,
        clients=clients,
        sources=sources,
        handlers=tuple(handlers),
        forwards=forwards,
        ordering=ordering,
        raw=raw,
    )


def _tables(raw: dict[str, Any], key: str, path: str) -> dict[str, dict[str, Any]]:
    tables = raw.get(key, {})
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise ConfigError(f"{path}: [{key}] must hold tables such as [{key}.<name>]")
    return tables


def _client(name: str, table: dict[str, Any], path: str) -> ClientConfig:
    token = table.get("token")
    if not isinstance(token, str) or len(token) < 16:
        raise ConfigError(f"{path}: [clients.{name}] token must be a string of 16+ characters")
    extra = set(table) - {"token", *_PROCESSING_KEYS}
    if extra:
        raise ConfigError(f"{path}: [clients.{name}] unknown key(s): {', '.join(sorted(extra))}")
    return ClientConfig(name=name, token=token)


# Keys read by the processing side (forwards and ordering), on sources and clients.
_PROCESSING_KEYS = {"forward", "version", "entity"}
_SOURCE_KEYS = {
    "provider",
    "secrets",
    "tolerance_seconds",
    "retention_days",
    "signature_header",
    "dedup_key",
    *_PROCESSING_KEYS,
}
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
# What a provider reads beyond the common keys (into SourceConfig.extra).
_PROVIDER_KEYS: dict[str, frozenset[str]] = {
    "generic": frozenset({"event_type"}) | HMAC_SCHEME_KEYS,
    "cloudevents": HMAC_SCHEME_KEYS,
}
CONSUMER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_FORWARD_KEYS = {"name", "url", "timeout_seconds", "event_types", "max_attempts"}


def _forwards(tables: Any, where: str) -> tuple[ForwardConfig, ...]:
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{where} must be an array of tables ([[...forward]])")
    result: list[ForwardConfig] = []
    for table in tables:
        name = table.get("name")
        if not isinstance(name, str) or not CONSUMER_NAME.match(name):
            raise ConfigError(
                f"{where} name must be 1-100 letters, digits, '.', '_' or '-' (got {name!r})"
            )
        here = f"{where} {name}:"
        unknown = set(table) - _FORWARD_KEYS
        if unknown:
            raise ConfigError(f"{here} unknown key(s): {', '.join(sorted(unknown))}")
        url = table.get("url")
        if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url):
            raise ConfigError(f"{here} url must be an http:// or https:// URL")
        timeout = table.get("timeout_seconds", 10)
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise ConfigError(f"{here} timeout_seconds must be a positive number")
        event_types = table.get("event_types")
        if event_types is not None and (
            not isinstance(event_types, list)
            or not all(isinstance(t, str) and t for t in event_types)
        ):
            raise ConfigError(f"{here} event_types must be a list of event type names")
        max_attempts = table.get("max_attempts")
        if max_attempts is not None and (
            not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1
        ):
            raise ConfigError(f"{here} max_attempts must be a positive integer")
        if any(f.name == name for f in result):
            raise ConfigError(f"{where} two forwards are named {name!r}")
        result.append(
            ForwardConfig(
                name=name,
                url=url,
                timeout_seconds=timeout,
                event_types=None if event_types is None else tuple(event_types),
                max_attempts=max_attempts,
            )
        )
    return tuple(result)


def _ordering(table: dict[str, Any], where: str) -> OrderingConfig | None:
    version, entity = table.get("version"), table.get("entity")
    if version is None and entity is None:
        return None
    return OrderingConfig(
        version=_json_pointer("version", version, where),
        entity=_json_pointer("entity", entity, where),
    )


def _json_pointer(key: str, value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.startswith("json:/"):
        raise ConfigError(
            f"{where} {key} must be 'json:<pointer>' (version and entity go together)"
        )
    return value[len("json:") :]


def _source(name: str, table: dict[str, Any], path: str) -> SourceConfig:
    where = f"{path}: [sources.{name}]"
    if not name or "/" in name or name.startswith("api:"):
        raise ConfigError(f"{where} is not a usable source name")
    provider = table.get("provider")
    if provider not in PROVIDER_NAMES:
        raise ConfigError(f"{where} provider must be one of {', '.join(sorted(PROVIDER_NAMES))}")
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
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where} {key} must be a positive integer")
    signature_header = table.get("signature_header")
    if provider in ("generic", "cloudevents") and not isinstance(signature_header, str):
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
            if not _is_standard_secret(secret):
                raise ConfigError(f"{where} secrets must be whsec_<base64> for provider standard")
    if provider in ("generic", "cloudevents"):
        _check_hmac_scheme(table, secrets, where)
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


def _is_standard_secret(secret: str) -> bool:
    import base64
    import binascii

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


def _check_hmac_scheme(table: dict[str, Any], secrets: list[str], where: str) -> None:
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
    import base64
    import binascii

    try:
        return bool(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError):
        return False
