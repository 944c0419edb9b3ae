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
from urllib.parse import urlsplit, urlunsplit

from . import pointers

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
# Broker sources are consumed by ``flask consume`` (webhook_receiver.brokers),
# never received over HTTP, so they are kept apart from the providers above.
BROKER_PROVIDERS = frozenset({"rabbitmq", "nats"})
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
    # Deliveries one worker process runs at once; each forward takes at most
    # its ``concurrency`` of them (see docs/processing.md).
    "WORKER_THREADS": 4,
    # PostgreSQL connections (database.init_app): a statement running longer
    # is cancelled, and answered as the database being away; 0 sets none.
    "DATABASE_STATEMENT_TIMEOUT_SECONDS": 30.0,
    # A database call still running after this long logs one warning
    # (database.stall_watch).
    "DATABASE_STALL_WARNING_SECONDS": 5.0,
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
    "WORKER_THREADS": (int, 1),
    "DATABASE_STATEMENT_TIMEOUT_SECONDS": (float, 0),
    "DATABASE_STALL_WARNING_SECONDS": (float, 0.001),
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
    if kind == "json":
        pointers.parse(arg)  # the parser every intake resolves with (a ValueError)
    return kind, arg


def redact_url(url: str) -> str:
    """The URL with any password, lone user part and query replaced by [redacted].

    A user part without a password is a token for NATS (``nats://TOKEN@host``)
    and for many HTTP APIs; queries carry tokens too.
    """
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        host = netloc.rpartition("@")[2]
        if parts.password is not None:
            netloc = f"{parts.username or ''}:[redacted]@{host}"
        elif "@" in netloc:
            netloc = f"[redacted]@{host}"
        query = "[redacted]" if parts.query else ""
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "[unparsable URL]"


@dataclass(frozen=True)
class BrokerSourceConfig:
    """One ``[sources.<name>]`` table whose provider is a broker (rabbitmq or nats)."""

    name: str
    provider: str
    url: str = field(repr=False)
    dedup_key: str
    event_type: str
    # Most messages taken into one batch commit (``prefetch`` or ``batch``).
    batch: int
    retention_days: int = 30
    queue: str | None = None
    stream: str | None = None
    durable: str | None = None
    filter_subject: str | None = None
    dead_letter_subject: str | None = None

    @property
    def safe_url(self) -> str:
        """The URL with its password redacted, for logs and pages."""
        return redact_url(self.url)

    def __repr__(self) -> str:
        where = self.queue if self.provider == "rabbitmq" else self.stream
        return (
            f"BrokerSourceConfig(name={self.name!r}, provider={self.provider!r}, "
            f"url={self.safe_url!r}, from={where!r})"
        )


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
    # Deliveries of this forward one worker process runs at once: a stalled
    # target holds no more of the worker's threads than this.
    concurrency: int = 1
    # amqp:// forwards publish to an exchange with a routing key ("{event_type}"
    # in it is replaced); nats:// forwards to a JetStream subject.
    exchange: str = ""
    routing_key: str | None = None
    subject: str | None = None
    # Standard Webhooks secrets an HTTP forward signs with (one signature each).
    signing_secrets: tuple[str, ...] = field(default=(), repr=False)

    @property
    def scheme(self) -> str:
        """The URL's scheme: http, https, amqp, amqps or nats."""
        return self.url.partition("://")[0].lower()

    def __repr__(self) -> str:
        return (
            f"ForwardConfig(name={self.name!r}, url={redact_url(self.url)!r}, "
            f"signed={bool(self.signing_secrets)})"
        )


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
    sources = {
        name: _source(name, table, path)
        for name, table in source_tables.items()
        if table.get("provider") not in BROKER_PROVIDERS
    }
    brokers = {
        name: _broker_source(name, table, path)
        for name, table in source_tables.items()
        if table.get("provider") in BROKER_PROVIDERS
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
        brokers=brokers,
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
_FORWARD_KEYS = {"name", "url", "timeout_seconds", "event_types", "max_attempts", "concurrency"}
# Keys only some forward URL schemes read.
_SCHEME_KEYS: dict[str, frozenset[str]] = {
    "http": frozenset({"signing_secret", "signing_secrets"}),
    "https": frozenset({"signing_secret", "signing_secrets"}),
    "amqp": frozenset({"exchange", "routing_key"}),
    "amqps": frozenset({"exchange", "routing_key"}),
    "nats": frozenset({"subject"}),
    "tls": frozenset({"subject"}),
}


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
        url = table.get("url")
        scheme = url.partition("://")[0].lower() if isinstance(url, str) else ""
        if (
            not isinstance(url, str)
            or scheme not in _SCHEME_KEYS
            or not re.match(r"^[a-z]+://[^/\s]+", url, re.IGNORECASE)
        ):
            raise ConfigError(
                f"{here} url must be an http://, https://, amqp://, amqps:// or nats:// URL"
            )
        unknown = set(table) - _FORWARD_KEYS - _SCHEME_KEYS[scheme]
        if unknown:
            raise ConfigError(
                f"{here} unknown key(s): {', '.join(sorted(unknown))} (in a {scheme}:// forward)"
            )
        transport = _forward_transport(table, scheme, here)
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
        concurrency = table.get("concurrency", 1)
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            raise ConfigError(f"{here} concurrency must be a positive integer")
        if any(f.name == name for f in result):
            raise ConfigError(f"{where} two forwards are named {name!r}")
        result.append(
            ForwardConfig(
                name=name,
                url=url,
                timeout_seconds=timeout,
                event_types=None if event_types is None else tuple(event_types),
                max_attempts=max_attempts,
                concurrency=concurrency,
                **transport,
            )
        )
    return tuple(result)


def _forward_transport(table: dict[str, Any], scheme: str, here: str) -> dict[str, Any]:
    """The scheme-specific settings of a forward: exchange and routing key, subject, or secrets."""
    if scheme in ("amqp", "amqps"):
        exchange = table.get("exchange", "")
        routing_key = table.get("routing_key")
        if not isinstance(exchange, str):
            raise ConfigError(f"{here} exchange must be a string ('' is the default exchange)")
        if not isinstance(routing_key, str) or not routing_key:
            raise ConfigError(f"{here} routing_key must be a non-empty string")
        return {"exchange": exchange, "routing_key": routing_key}
    if scheme in ("nats", "tls"):
        subject = table.get("subject")
        if not isinstance(subject, str) or not _SUBJECT.match(subject):
            raise ConfigError(f"{here} subject must be a NATS subject without wildcards")
        return {"subject": subject}
    if "signing_secret" in table and "signing_secrets" in table:
        raise ConfigError(f"{here} give signing_secret or signing_secrets, not both")
    secrets = table.get("signing_secrets", [])
    if "signing_secret" in table:
        secrets = [table["signing_secret"]]
    if not isinstance(secrets, list) or not all(
        isinstance(s, str) and _is_standard_secret(s) for s in secrets
    ):
        raise ConfigError(f"{here} signing secrets must be whsec_<base64> strings")
    if "signing_secrets" in table and not secrets:
        raise ConfigError(f"{here} signing_secrets must not be empty")
    return {"signing_secrets": tuple(secrets)}


_SUBJECT = re.compile(r"^[^\s*>.]+(\.[^\s*>.]+)*$")
_BROKER_KEYS = {"provider", "url", "dedup_key", "event_type", "retention_days", *_PROCESSING_KEYS}
_BROKER_PROVIDER_KEYS = {
    "rabbitmq": frozenset({"queue", "prefetch"}),
    "nats": frozenset({"stream", "durable", "filter_subject", "dead_letter_subject", "batch"}),
}
_BROKER_DEFAULTS = {
    "rabbitmq": {"dedup_key": "property:message_id", "event_type": "property:type"},
    "nats": {"dedup_key": "header:Nats-Msg-Id", "event_type": "subject"},
}
_URL_SCHEMES = {"rabbitmq": ("amqp", "amqps"), "nats": ("nats", "tls")}
# Values a broker sets anew on each delivery (or per publish): a key taken
# from one would make every redelivery look like a new message.
PER_DELIVERY = frozenset(
    {
        "property:timestamp",
        "property:expiration",
        "header:nats-num-delivered",
        "header:nats-sequence",
        "header:nats-time-stamp",
        "header:x-delivery-count",
        "header:x-death",
    }
)


def _broker_source(name: str, table: dict[str, Any], path: str) -> BrokerSourceConfig:
    where = f"{path}: [sources.{name}]"
    if not name or "/" in name or name.startswith("api:"):
        raise ConfigError(f"{where} is not a usable source name")
    provider = table["provider"]
    unknown = set(table) - _BROKER_KEYS - _BROKER_PROVIDER_KEYS[provider]
    if unknown:
        raise ConfigError(
            f"{where} unknown key(s) for provider {provider}: {', '.join(sorted(unknown))}"
        )
    url = table.get("url")
    if not isinstance(url, str) or url.partition("://")[0].lower() not in _URL_SCHEMES[provider]:
        schemes = " or ".join(f"{s}://" for s in _URL_SCHEMES[provider])
        raise ConfigError(f"{where} url must be a {schemes} URL")
    specs = {key: table.get(key, default) for key, default in _BROKER_DEFAULTS[provider].items()}
    for key, spec in specs.items():
        try:
            parse_broker_spec(spec, provider, key)
        except ValueError as exc:
            raise ConfigError(f"{where} {key}: {exc}") from exc
    retention = table.get("retention_days", 30)
    size_key = "prefetch" if provider == "rabbitmq" else "batch"
    batch = table.get(size_key, 200)
    for key, value in (("retention_days", retention), (size_key, batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where} {key} must be a positive integer")
    if provider == "rabbitmq":
        queue = table.get("queue")
        if not isinstance(queue, str) or not queue:
            raise ConfigError(f"{where} queue must name an existing queue")
        return BrokerSourceConfig(
            name=name,
            provider=provider,
            url=url,
            retention_days=retention,
            batch=min(batch, 65535),
            queue=queue,
            **specs,
        )
    stream = table.get("stream")
    durable = table.get("durable", "webhook-receiver")
    if not isinstance(stream, str) or not re.match(r"^[^\s.*>]+$", stream):
        raise ConfigError(f"{where} stream must name an existing JetStream stream")
    if not isinstance(durable, str) or not re.match(r"^[^\s.*>]+$", durable):
        raise ConfigError(f"{where} durable must be a consumer name (no spaces, '.', '*' or '>')")
    filter_subject = table.get("filter_subject")
    if filter_subject is not None and (not isinstance(filter_subject, str) or not filter_subject):
        raise ConfigError(f"{where} filter_subject must be a subject")
    dead = table.get("dead_letter_subject")
    if dead is not None and (not isinstance(dead, str) or not _SUBJECT.match(dead)):
        raise ConfigError(f"{where} dead_letter_subject must be a subject without wildcards")
    if dead is not None and filter_subject is not None and subject_covers(filter_subject, dead):
        # The copy would land in the consumed stream and come straight back.
        raise ConfigError(
            f"{where} dead_letter_subject {dead!r} is inside filter_subject "
            f"{filter_subject!r}: the consumer would take its own dead letters; "
            "choose a subject outside it, in a stream of its own"
        )
    return BrokerSourceConfig(
        name=name,
        provider=provider,
        url=url,
        retention_days=retention,
        batch=batch,
        stream=stream,
        durable=durable,
        filter_subject=filter_subject,
        dead_letter_subject=dead,
        **specs,
    )


def subject_covers(pattern: str, subject: str) -> bool:
    """Tell whether every subject ``subject`` names is one NATS delivers to ``pattern``.

    ``*`` stands for one token and a final ``>`` for one or more; ``subject``
    may hold wildcards too (a filter or a stream's subjects), and is covered
    when all it can name is.
    """
    wanted, given = pattern.split("."), subject.split(".")
    for n, part in enumerate(wanted):
        if part == ">":
            return len(given) > n
        if n >= len(given) or given[n] == ">":
            return False
        if part != "*" and part != given[n]:
            return False
    return len(wanted) == len(given)


def parse_broker_spec(spec: Any, provider: str, key: str = "dedup_key") -> tuple[str, str]:
    """Split a broker source's key or type spec into kind and argument (ValueError).

    ``property:<name>`` (RabbitMQ), ``header:<name>``, ``json:<pointer>``, and
    ``subject`` (NATS, event type only).
    """
    if not isinstance(spec, str):
        raise ValueError(f"{spec!r} is not a string")
    if spec == "subject":
        if provider != "nats" or key != "event_type":
            raise ValueError("'subject' is the event type of a NATS source only")
        return "subject", ""
    kind, sep, arg = spec.partition(":")
    if kind == "property":
        if provider != "rabbitmq" or not sep or not arg:
            raise ValueError(f"{spec!r}: 'property:<name>' is for RabbitMQ sources")
        if arg not in AMQP_PROPERTIES:
            raise ValueError(f"{spec!r}: no AMQP property {arg!r}")
    else:
        parse_spec(spec)
    if spec.lower() in PER_DELIVERY:
        # The type is fingerprinted too: every redelivery would be a conflict.
        what = "a dedup key" if key == "dedup_key" else "an event type"
        raise ValueError(f"{spec!r} changes with each delivery and cannot be {what}")
    return kind, arg


# The AMQP basic properties a spec may name (pika's attribute names).
AMQP_PROPERTIES = frozenset(
    {
        "message_id",
        "type",
        "correlation_id",
        "app_id",
        "user_id",
        "reply_to",
        "content_type",
        "content_encoding",
        "timestamp",
        "expiration",
        "priority",
        "delivery_mode",
        "cluster_id",
    }
)


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
    pointer = value[len("json:") :]
    try:
        pointers.parse(pointer)  # the parser the ordering rule resolves with
    except pointers.PointerError as exc:
        raise ConfigError(f"{where} {key}: {exc}") from exc
    return pointer


def _source(name: str, table: dict[str, Any], path: str) -> SourceConfig:
    where = f"{path}: [sources.{name}]"
    if not name or "/" in name or name.startswith("api:"):
        raise ConfigError(f"{where} is not a usable source name")
    provider = table.get("provider")
    if provider not in PROVIDER_NAMES:
        names = sorted(PROVIDER_NAMES | BROKER_PROVIDERS)
        raise ConfigError(f"{where} provider must be one of {', '.join(names)}")
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
