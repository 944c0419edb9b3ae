"""Forwards and ordering rules: the ``[[<table>.forward]]`` arrays and ``version``/``entity``.

Both sources and clients may carry them; the keys they add to a table are
``PROCESSING_KEYS``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from .. import pointers
from .filters import Filter, parse_filter
from .settings import DAY, ConfigError, redact_url, url_problem
from .signing import is_standard_secret

# Keys read by the processing side (forwards and ordering), on sources and clients.
PROCESSING_KEYS = {"forward", "version", "entity"}
CONSUMER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_FORWARD_KEYS = {
    "name",
    "url",
    "timeout_seconds",
    "event_types",
    "max_attempts",
    "concurrency",
    "max_per_second",
    "circuit_breaker",
    "filter",
}
# Keys only some forward URL schemes read.
_SCHEME_KEYS: dict[str, frozenset[str]] = {
    "http": frozenset({"signing_secret", "signing_secrets"}),
    "https": frozenset({"signing_secret", "signing_secrets"}),
    "amqp": frozenset({"exchange", "routing_key"}),
    "amqps": frozenset({"exchange", "routing_key"}),
    "nats": frozenset({"subject"}),
    "tls": frozenset({"subject"}),
    "kafka": frozenset(
        {
            "topic",
            "key",
            "security_protocol",
            "sasl_mechanism",
            "sasl_username",
            "sasl_password",
            "ssl_ca_location",
        }
    ),
    "redis": frozenset({"stream"}),
    "rediss": frozenset({"stream"}),
    "mqtt": frozenset({"topic"}),
    "mqtts": frozenset({"topic"}),
    "sqs": frozenset({"region", "endpoint_url"}),
    "pubsub": frozenset(),
}
# A NATS subject without wildcards (a forward's, a dead-letter subject).
NATS_SUBJECT = re.compile(r"^[^\s*>.]+(\.[^\s*>.]+)*$")
# A Kafka forward's record key: the event's dedup key or its type.
KAFKA_RECORD_KEYS = ("{dedup_key}", "{event_type}")
# Kafka's legal topic names (its Topic.validate): "." and ".." are not.
_KAFKA_TOPIC = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9._-]{1,249}$")
# One host:port of a kafka:// URL (a bracketed IPv6 address too).
_KAFKA_SERVER = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$")
# A Kafka forward's or source's security keys, and librdkafka's name for each.
KAFKA_SECURITY_KEYS = {
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanisms",
    "sasl_username": "sasl.username",
    "sasl_password": "sasl.password",
    "ssl_ca_location": "ssl.ca.location",
}
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
# The mechanisms a username and password sign in with.
_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


# The slowest rate limit: one send per 100,000 s (a little over a day).
MIN_PER_SECOND = 0.00001


@dataclass(frozen=True)
class CircuitBreakerConfig:
    """A forward's ``circuit_breaker``: consecutive failures that open it, and its cool-down."""

    failures: int = 5
    cool_down_seconds: float = 60


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
    # Sends per second to the target over every worker and host (None: no limit).
    max_per_second: float | None = None
    # On by default; None (``circuit_breaker = false``) never opens it.
    circuit_breaker: CircuitBreakerConfig | None = CircuitBreakerConfig()
    # Only events whose JSON body this finds true get a delivery (None: every event).
    filter: Filter | None = None
    # amqp:// forwards publish to an exchange with a routing key ("{event_type}"
    # in it is replaced); nats:// forwards to a JetStream subject.
    exchange: str = ""
    routing_key: str | None = None
    subject: str | None = None
    # kafka:// forwards produce to a topic; the record's key is the event's
    # dedup key or type (KAFKA_RECORD_KEYS). ``bootstrap_servers`` is the
    # URL's host:port list; ``client_settings`` are librdkafka's security
    # settings, the SASL password among them: never shown.
    topic: str | None = None
    key: str | None = None
    bootstrap_servers: str | None = None
    client_settings: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # redis:// forwards add an entry to a stream (XADD); mqtt:// forwards
    # publish with QoS 1 on ``topic``.
    stream: str | None = None
    # sqs:// forwards send to the queue the URL names (sqs://<host>/<account>/<name>),
    # through ``endpoint_url`` when set; pubsub:// ones publish to
    # pubsub://<project>/<topic>. SQS's region is ``region``.
    region: str | None = None
    endpoint_url: str | None = None
    # Standard Webhooks secrets an HTTP forward signs with (one signature each).
    signing_secrets: tuple[str, ...] = field(default=(), repr=False)

    @property
    def scheme(self) -> str:
        """The URL's scheme: http, https, amqp, amqps, nats, tls or kafka."""
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


def parse_forwards(tables: Any, where: str) -> tuple[ForwardConfig, ...]:
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
                f"{here} url must be an http://, https://, amqp://, amqps://, nats://, "
                "kafka://, redis://, mqtt://, sqs:// or pubsub:// URL"
            )
        # A Kafka URL lists brokers after commas, and a Pub/Sub project may hold
        # a ':': both are checked by their own transports.
        problem = None if scheme in ("kafka", "pubsub") else url_problem(url)
        if problem:
            raise ConfigError(f"{here} url {problem}")
        unknown = set(table) - _FORWARD_KEYS - _SCHEME_KEYS[scheme]
        if unknown:
            raise ConfigError(
                f"{here} unknown key(s): {', '.join(sorted(unknown))} (in a {scheme}:// forward)"
            )
        transport = _forward_transport(table, scheme, here)
        timeout = table.get("timeout_seconds", 10)
        if not _positive_finite(timeout):
            raise ConfigError(f"{here} timeout_seconds must be a positive number, not nan or inf")
        _check_at_most(timeout, "timeout_seconds", here)
        event_types = table.get("event_types")
        # An empty list would match no event: a forward that never forwards.
        if event_types is not None and (
            not isinstance(event_types, list)
            or not event_types
            or not all(isinstance(t, str) and t for t in event_types)
        ):
            raise ConfigError(
                f"{here} event_types must be a non-empty list of event type names "
                "(leave it out for every type)"
            )
        max_attempts = table.get("max_attempts")
        if max_attempts is not None and (
            not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1
        ):
            raise ConfigError(f"{here} max_attempts must be a positive integer")
        if max_attempts is not None:
            _check_at_most(max_attempts, "max_attempts", here)
        concurrency = table.get("concurrency", 1)
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            raise ConfigError(f"{here} concurrency must be a positive integer")
        _check_at_most(concurrency, "concurrency", here)
        max_per_second = table.get("max_per_second")
        if max_per_second is not None and (
            not isinstance(max_per_second, int | float)
            or isinstance(max_per_second, bool)
            # Slower than about one send a day, a target's next send could
            # fall past what a timestamp holds.
            or not MIN_PER_SECOND <= max_per_second <= 100_000
        ):
            raise ConfigError(
                f"{here} max_per_second must be a number from {MIN_PER_SECOND:g}"
                " (about one send a day) to 100000"
            )
        if any(f.name == name for f in result):
            raise ConfigError(f"{where} two forwards are named {name!r}")
        # As source names: a typo would make a second forward, its own deliveries and breaker.
        twin = next((f.name for f in result if f.name.casefold() == name.casefold()), None)
        if twin is not None:
            raise ConfigError(
                f"{where} forwards {twin!r} and {name!r} differ only in case: "
                "rename one (they would be two forwards)"
            )
        result.append(
            ForwardConfig(
                name=name,
                url=url,
                timeout_seconds=timeout,
                event_types=None if event_types is None else tuple(event_types),
                max_attempts=max_attempts,
                concurrency=concurrency,
                max_per_second=max_per_second,
                circuit_breaker=parse_circuit_breaker(table.get("circuit_breaker", {}), here),
                filter=parse_filter(table["filter"], here) if "filter" in table else None,
                **transport,
            )
        )
    return tuple(result)


# A forward's numbers' largest values, and why. A worker's lease (at most a
# week) must exceed twice the timeout; a cool-down past year 9999 overflowed
# the breaker's retry time (OverflowError in the worker).
FORWARD_MAXIMA: dict[str, tuple[int, str]] = {
    "timeout_seconds": (DAY, "1 day: a call's whole wait"),
    "max_attempts": (1_000_000, "far within the 32-bit count of attempts"),
    # More than any worker runs at once (WORKER_THREADS is at most 9).
    "concurrency": (1_000, "no worker runs more deliveries at once"),
    "circuit_breaker.failures": (1_000_000, "a breaker that still opens"),
    "circuit_breaker.cool_down_seconds": (DAY, "1 day: a target's pause"),
}


def _check_at_most(value: float, key: str, here: str) -> None:
    largest, why = FORWARD_MAXIMA[key]
    if value > largest:
        raise ConfigError(
            f"{here} {key} must be above 0 and at most {largest:,} ({why}), got {value!r}"
        )


def _positive_finite(value: Any) -> bool:
    """A number of seconds: TOML's nan passed "<= 0", and inf never ended a wait."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def parse_circuit_breaker(value: Any, here: str) -> CircuitBreakerConfig | None:
    """``circuit_breaker = { failures = 5, cool_down_seconds = 60 }`` (the defaults), or false."""
    if value is False:
        return None
    if not isinstance(value, dict) or set(value) - {"failures", "cool_down_seconds"}:
        raise ConfigError(
            f"{here} circuit_breaker must be false or a table of failures and cool_down_seconds"
        )
    failures = value.get("failures", 5)
    cool_down = value.get("cool_down_seconds", 60)
    if not isinstance(failures, int) or isinstance(failures, bool) or failures < 1:
        raise ConfigError(f"{here} circuit_breaker.failures must be a positive integer")
    if not _positive_finite(cool_down):
        raise ConfigError(
            f"{here} circuit_breaker.cool_down_seconds must be a positive number, not nan or inf"
        )
    _check_at_most(failures, "circuit_breaker.failures", here)
    _check_at_most(cool_down, "circuit_breaker.cool_down_seconds", here)
    return CircuitBreakerConfig(failures, cool_down)


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
        if not isinstance(subject, str) or not NATS_SUBJECT.match(subject):
            raise ConfigError(f"{here} subject must be a NATS subject without wildcards")
        return {"subject": subject}
    if scheme == "kafka":
        return _kafka_transport(table, here)
    if scheme in ("redis", "rediss"):
        stream = table.get("stream")
        if not isinstance(stream, str) or not stream:
            raise ConfigError(f"{here} stream must name a Redis stream")
        return {"stream": stream}
    if scheme in ("mqtt", "mqtts"):
        topic = table.get("topic")
        if (
            not isinstance(topic, str)
            or not topic
            or any(c in topic for c in "+#\x00")
            or len(topic.encode()) > 65535
        ):
            raise ConfigError(f"{here} topic must be an MQTT topic name without wildcards")
        return {"topic": topic}
    if scheme in ("sqs", "pubsub"):
        return cloud_queue_transport(table, scheme, here)
    if "signing_secret" in table and "signing_secrets" in table:
        raise ConfigError(f"{here} give signing_secret or signing_secrets, not both")
    secrets = table.get("signing_secrets", [])
    if "signing_secret" in table:
        secrets = [table["signing_secret"]]
    if not isinstance(secrets, list) or not all(
        isinstance(s, str) and is_standard_secret(s) for s in secrets
    ):
        raise ConfigError(f"{here} signing secrets must be whsec_<base64> strings")
    if "signing_secrets" in table and not secrets:
        raise ConfigError(f"{here} signing_secrets must not be empty")
    return {"signing_secrets": tuple(secrets)}


def _kafka_transport(table: dict[str, Any], here: str) -> dict[str, Any]:
    """A Kafka forward's brokers, topic, record key and security settings."""
    servers, username, password = _kafka_url(table["url"], here)
    topic = table.get("topic")
    if not isinstance(topic, str) or not _KAFKA_TOPIC.match(topic):
        raise ConfigError(
            f"{here} topic must be a Kafka topic name (1-249 letters, digits, '.', '_' or '-')"
        )
    key = table.get("key", "{dedup_key}")
    if key not in KAFKA_RECORD_KEYS:
        raise ConfigError(f"{here} key must be '{{dedup_key}}' or '{{event_type}}'")
    if password is not None and ("sasl_username" in table or "sasl_password" in table):
        raise ConfigError(
            f"{here} give the SASL credentials in the url or as sasl_username and "
            "sasl_password, not both"
        )
    values = dict(table)
    if password is not None:
        values.update(sasl_username=username, sasl_password=password)
    return {
        "topic": topic,
        "key": key,
        "bootstrap_servers": servers,
        "client_settings": kafka_security(values, here),
    }


def _kafka_url(url: str, here: str) -> tuple[str, str | None, str | None]:
    """``kafka://[user:password@]host:port[,host:port...]``: its servers and credentials."""
    rest = url.partition("://")[2]
    userinfo, at, hosts = rest.rpartition("@")
    servers = hosts.split(",")
    # A "/" (or "?", "#") ends a URL's host part: one in the password must be
    # percent-encoded, else the URL's redaction would not find the password.
    if (
        any(c in rest for c in "/?#")
        or not all(_KAFKA_SERVER.match(s) for s in servers)
        or any(url_problem(f"kafka://{s}") for s in servers)
    ):
        raise ConfigError(
            f"{here} url must be kafka://host:port, with more brokers after commas "
            "(kafka://host1:9092,host2:9092), each port from 1 to 65535"
        )
    if not at:
        return hosts, None, None
    username, colon, password = userinfo.partition(":")
    if not username or not colon or not password:
        raise ConfigError(f"{here} the url's user part must be <username>:<password>")
    return hosts, unquote(username), unquote(password)


def kafka_security(table: dict[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    """librdkafka's security settings of a Kafka table, checked; the password is never shown.

    ``security_protocol`` (default PLAINTEXT), ``sasl_mechanism`` with
    ``sasl_username`` and ``sasl_password`` (needs a SASL_ protocol), and
    ``ssl_ca_location`` (needs SSL or SASL_SSL).
    """
    for name in KAFKA_SECURITY_KEYS:
        value = table.get(name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{where} {name} must be a non-empty string")
    protocol = str(table.get("security_protocol", "PLAINTEXT")).upper()
    if protocol not in SECURITY_PROTOCOLS:
        raise ConfigError(
            f"{where} security_protocol must be one of {', '.join(SECURITY_PROTOCOLS)}"
        )
    sasl = [name for name in ("sasl_mechanism", "sasl_username", "sasl_password") if name in table]
    if protocol.startswith("SASL_"):
        if len(sasl) < 3:
            raise ConfigError(
                f"{where} security_protocol {protocol} needs sasl_mechanism, sasl_username "
                "and sasl_password"
            )
        if str(table["sasl_mechanism"]).upper() not in _SASL_MECHANISMS:
            raise ConfigError(
                f"{where} sasl_mechanism must be one of {', '.join(_SASL_MECHANISMS)}"
            )
    elif sasl:
        # librdkafka would send no credentials at all, and the broker refuse every request.
        raise ConfigError(
            f"{where} {', '.join(sasl)} need(s) security_protocol SASL_SSL or SASL_PLAINTEXT"
        )
    if "ssl_ca_location" in table and not protocol.endswith("SSL"):
        raise ConfigError(f"{where} ssl_ca_location needs security_protocol SSL or SASL_SSL")
    settings = {"security_protocol": protocol}
    if protocol.startswith("SASL_"):
        settings["sasl_mechanism"] = str(table["sasl_mechanism"]).upper()
    settings.update(
        (name, table[name])
        for name in ("sasl_username", "sasl_password", "ssl_ca_location")
        if name in table
    )
    return tuple((KAFKA_SECURITY_KEYS[name], value) for name, value in settings.items())


def parse_ordering(table: dict[str, Any], where: str) -> OrderingConfig | None:
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


# An SQS forward's URL: sqs://<host>/<account>/<queue> (a FIFO queue's ends in .fifo).
_SQS_FORWARD = re.compile(r"^sqs://[^/\s@]+/[0-9A-Za-z_-]+/[A-Za-z0-9_-]{1,80}(\.fifo)?$")
# A Pub/Sub forward's URL: pubsub://<project>/<topic>.
_PUBSUB_FORWARD = re.compile(
    r"^pubsub://[a-z][a-z0-9:.-]{0,98}[a-z0-9]/[A-Za-z][A-Za-z0-9._~+%-]{2,254}$"
)
_AWS_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-[0-9]+$")
_SQS_HOST_REGION = re.compile(r"^sqs\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?$")


def cloud_queue_transport(table: dict[str, Any], scheme: str, here: str) -> dict[str, Any]:
    """An sqs:// forward's region and endpoint, checked with its URL; a pubsub:// one's URL."""
    url = table["url"]
    if scheme == "pubsub":
        if not _PUBSUB_FORWARD.match(url):
            raise ConfigError(f"{here} url must be pubsub://<project>/<topic>")
        return {}
    if not _SQS_FORWARD.match(url):
        raise ConfigError(f"{here} url must be sqs://<host>/<account>/<queue>")
    endpoint = table.get("endpoint_url") or None
    if endpoint is not None and (
        not isinstance(endpoint, str)
        or not re.match(r"^https?://[^/\s@]+/?$", endpoint)
        or url_problem(endpoint)
    ):
        raise ConfigError(f"{here} endpoint_url must be an http:// or https:// URL (no path)")
    region = table.get("region")
    if region is None:
        found = _SQS_HOST_REGION.match(url.removeprefix("sqs://").partition("/")[0])
        region = found.group(1) if found else None
    if not isinstance(region, str) or not _AWS_REGION.match(region):
        raise ConfigError(f"{here} region must be an AWS region (eu-west-1)")
    return {"region": region, "endpoint_url": endpoint}
