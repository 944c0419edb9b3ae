"""Configuration: defaults, then the environment, then the TOML file.

Plain settings come from the environment (``DATABASE_URL``, ``SECRET_KEY``
and ``WEBHOOK_RECEIVER_*``, read by Flask's ``from_prefixed_env``). The TOML
file at ``WEBHOOK_RECEIVER_CONFIG`` declares who may talk to us: API clients
(``[clients.*]``), provider sources (``[sources.*]``) and handler modules.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .webhooks.providers.base import SourceConfig

PROVIDER_NAMES = frozenset(
    {"stripe", "github", "gitlab", "standard", "shopify", "slack", "cloudevents", "generic"}
)
# Stripe and Standard Webhooks retry for about three days; operators replay
# dead letters later still. Markers kept for less let duplicates back in.
MIN_RETENTION_DAYS = 3

DEFAULTS: dict[str, Any] = {
    "MAX_BODY_BYTES": 1024 * 1024,
    "IDEMPOTENCY_LEASE_SECONDS": 60,
    "IDEMPOTENCY_TTL_SECONDS": 24 * 3600,
    "PURGE_BATCH_SIZE": 1000,
    "ADMIN_PASSWORD": None,
    "METRICS_TOKEN": None,
    "SESSION_COOKIE_SECURE": False,
    "FORCE_SHORT_RETENTION": False,
    "SQLALCHEMY_ENGINE_OPTIONS": {},
}

# A placeholder that must never reach production.
DEV_SECRET_KEY = "dev-insecure-secret-key"


class ConfigError(Exception):
    """The configuration cannot be used; the message names what and where."""


@dataclass(frozen=True)
class ClientConfig:
    """One ``[clients.<name>]`` table: an API client and its bearer token."""

    name: str
    token: str = field(repr=False)


@dataclass(frozen=True)
class FileConfig:
    """The validated contents of the TOML file."""

    path: str
    clients: dict[str, ClientConfig] = field(default_factory=dict)
    sources: dict[str, SourceConfig] = field(default_factory=dict)
    handlers: tuple[str, ...] = ()
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
    clients = {
        name: _client(name, table, path) for name, table in _tables(raw, "clients", path).items()
    }
    tokens = [c.token for c in clients.values()]
    if len(set(tokens)) != len(tokens):
        raise ConfigError(f"{path}: two clients share one token")
    sources = {
        name: _source(name, table, path) for name, table in _tables(raw, "sources", path).items()
    }
    handlers = raw.get("handlers", [])
    if not isinstance(handlers, list) or not all(isinstance(h, str) for h in handlers):
        raise ConfigError(f"{path}: handlers must be a list of module names")
    return FileConfig(
        path=path, clients=clients, sources=sources, handlers=tuple(handlers), raw=raw
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
    extra = set(table) - {"token"}
    if extra:
        raise ConfigError(f"{path}: [clients.{name}] unknown key(s): {', '.join(sorted(extra))}")
    return ClientConfig(name=name, token=token)


_SOURCE_KEYS = {
    "provider",
    "secrets",
    "tolerance_seconds",
    "retention_days",
    "signature_header",
    "dedup_key",
}


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
    if not isinstance(dedup_key, str) or not dedup_key.startswith(("header:", "json:")):
        raise ConfigError(f"{where} dedup_key must be 'header:<Name>' or 'json:<pointer>'")
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
