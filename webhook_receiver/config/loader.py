"""The TOML file: read, validated table by table, into one ``FileConfig``.

The file at ``WEBHOOK_RECEIVER_CONFIG`` declares who may talk to us: API
clients (``[clients.*]``), webhook and broker sources (``[sources.*]``),
their forwards, and handler modules.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .brokers import BROKER_PROVIDERS, BrokerSourceConfig, broker_source
from .forwards import PROCESSING_KEYS, ForwardConfig, OrderingConfig, parse_forwards, parse_ordering
from .settings import ConfigError
from .sources import SourceConfig, check_source_name, source_config


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
    # Sources fed by a message broker; no /webhooks/<name> endpoint for them.
    brokers: dict[str, BrokerSourceConfig] = field(default_factory=dict)
    handlers: tuple[str, ...] = ()
    # Keyed by event source: a source name, or ``api:<client>``.
    forwards: dict[str, tuple[ForwardConfig, ...]] = field(default_factory=dict)
    ordering: dict[str, OrderingConfig] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def retention_days(self) -> dict[str, int]:
        """Each configured source's retention in days, webhook and broker sources alike."""
        days = {name: source.retention_days for name, source in self.sources.items()}
        days.update((name, source.retention_days) for name, source in self.brokers.items())
        return days

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


def load_file(
    path: str | os.PathLike[str], *, required: bool, providers: Collection[str]
) -> FileConfig:
    """Read and validate the TOML file; a missing optional file is an empty config."""
    path = str(path)
    if not Path(path).exists():
        if required:
            raise ConfigError(f"{path}: config file not found")
        return FileConfig(path=path)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc}") from exc
    # tomllib reads a BOM as an invalid statement, and raises
    # UnicodeDecodeError (a traceback) for bytes not UTF-8.
    if data.startswith(codecs.BOM_UTF8):
        raise ConfigError(
            f"{path}: starts with a byte-order mark (BOM): save the file as UTF-8 without one"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 at line {line}: save the file as UTF-8") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse(raw, path, providers=providers)


def load_for_app(
    settings: Mapping[str, Any], instance_path: str, *, providers: Collection[str]
) -> FileConfig:
    """The app's file config: a test's ``RECEIVER_CONFIG`` mapping, else the TOML file.

    The file is ``CONFIG`` or ``WEBHOOK_RECEIVER_CONFIG`` (required to exist),
    else ``config.toml`` in the instance folder (optional).
    """
    raw = settings.get("RECEIVER_CONFIG")
    if raw is not None:
        return parse(dict(raw), "<test config>", providers=providers)
    explicit = settings.get("CONFIG") or os.environ.get("WEBHOOK_RECEIVER_CONFIG")
    path = explicit or os.path.join(instance_path, "config.toml")
    return load_file(path, required=bool(explicit), providers=providers)


def parse(raw: dict[str, Any], path: str = "<config>", *, providers: Collection[str]) -> FileConfig:
    """Validate a config mapping (the TOML file's contents, or a test's dict).

    ``providers`` are the webhook providers a source may name: the provider
    registry's names, which the app factory hands down.
    """
    unknown = set(raw) - {"clients", "sources", "handlers"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s): {', '.join(sorted(unknown))}")
    client_tables = _tables(raw, "clients", path)
    _refuse_case_twins(client_tables, path, "clients")
    clients = {name: _client(name, table, path) for name, table in client_tables.items()}
    tokens = [c.token for c in clients.values()]
    if len(set(tokens)) != len(tokens):
        raise ConfigError(f"{path}: two clients share one token")
    source_tables = _tables(raw, "sources", path)
    _refuse_case_twins(source_tables, path, "sources")
    sources = {
        name: _source(name, table, path, providers)
        for name, table in source_tables.items()
        if not _is_broker(table)
    }
    brokers = {
        name: broker_source(name, table, path)
        for name, table in source_tables.items()
        if _is_broker(table)
    }
    forwards: dict[str, tuple[ForwardConfig, ...]] = {}
    ordering: dict[str, OrderingConfig] = {}
    for kind, tables, prefix in (
        ("clients", client_tables, "api:"),
        ("sources", source_tables, ""),
    ):
        for name, table in tables.items():
            where = f"{path}: [{kind}.{name}]"
            if "forward" in table:
                forwards[prefix + name] = parse_forwards(
                    table["forward"], f"{path}: [[{kind}.{name}.forward]]"
                )
            order = parse_ordering(table, where)
            if order is not None:
                ordering[prefix + name] = order
    handlers = raw.get("handlers", [])
    if not isinstance(handlers, list) or not all(isinstance(h, str) for h in handlers):
        raise ConfigError(f"{path}: handlers must be a list of module names")
    for n, handler in enumerate(handlers):
        # "" or "my app.x" passed here and failed only when imported.
        if not all(part.isidentifier() for part in handler.split(".")):
            raise ConfigError(
                f"{path}: handlers must be a list of Python module paths (myapp.handlers), "
                f"got {handler!r}"
            )
        # Listed twice, each handler was collected twice, and the start said
        # a source had two consumers of one name, not which module repeated.
        if handler in handlers[:n]:
            raise ConfigError(f"{path}: handlers lists {handler!r} twice")
    return FileConfig(
        path=path,
        clients=clients,
        sources=sources,
        brokers=brokers,
        handlers=tuple(handlers),
        forwards=forwards,
        ordering=ordering,
        raw=raw,
    )


def _source(
    name: str, table: dict[str, Any], path: str, providers: Collection[str]
) -> SourceConfig:
    where = f"{path}: [sources.{name}]"
    check_source_name(name, where)
    provider = table.get("provider")
    if not isinstance(provider, str) or provider not in providers:
        names = sorted({*providers, *BROKER_PROVIDERS})
        raise ConfigError(f"{where} provider must be one of {', '.join(names)}")
    return source_config(name, table, where)


def _refuse_case_twins(tables: dict[str, Any], path: str, kind: str) -> None:
    """Refuse two source or client names alike but for case: a typo would make a second one."""
    seen: dict[str, str] = {}
    for name in sorted(tables):
        twin = seen.setdefault(name.casefold(), name)
        if twin != name:
            raise ConfigError(
                f"{path}: [{kind}.{twin}] and [{kind}.{name}] differ only in case: "
                f"rename one (they would be two {kind})"
            )


def _is_broker(table: dict[str, Any]) -> bool:
    # A provider given as a list or table cannot be looked up in a set (unhashable).
    provider = table.get("provider")
    return isinstance(provider, str) and provider in BROKER_PROVIDERS


def _tables(raw: dict[str, Any], key: str, path: str) -> dict[str, dict[str, Any]]:
    tables = raw.get(key, {})
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise ConfigError(f"{path}: [{key}] must hold tables such as [{key}.<name>]")
    return tables


def _client(name: str, table: dict[str, Any], path: str) -> ClientConfig:
    token = table.get("token")
    if not isinstance(token, str) or len(token) < 16:
        raise ConfigError(f"{path}: [clients.{name}] token must be a string of 16+ characters")
    extra = set(table) - {"token", *PROCESSING_KEYS}
    if extra:
        raise ConfigError(f"{path}: [clients.{name}] unknown key(s): {', '.join(sorted(extra))}")
    return ClientConfig(name=name, token=token)
