"""Broker sources: the ``[sources.<name>]`` tables consumed by ``flask consume``."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, urlsplit

from .forwards import KAFKA_SECURITY_KEYS, NATS_SUBJECT, PROCESSING_KEYS, SECURITY_PROTOCOLS
from .settings import (
    CENTURY_DAYS,
    DAY,
    ConfigError,
    check_positive_integer,
    redact_url,
    url_problem,
)
from .sources import check_source_name, parse_spec

_BROKER_KEYS = {"provider", "dedup_key", "event_type", "retention_days", *PROCESSING_KEYS}
# Each broker's table: the keys only it reads. Its names are the brokers a
# source may name (brokers.runner.ADAPTERS has one consumer for each).
_BROKER_PROVIDER_KEYS = {
    "rabbitmq": frozenset({"url", "queue", "prefetch"}),
    "nats": frozenset(
        {"url", "stream", "durable", "filter_subject", "dead_letter_subject", "batch"}
    ),
    "kafka": frozenset(
        {
            "bootstrap_servers",
            "topics",
            "group_id",
            "dead_letter_topic",
            "offsets",
            "batch",
            "security_protocol",
            "sasl_mechanism",
            "sasl_username",
            "sasl_password",
            "ssl_ca_location",
        }
    ),
    "redis": frozenset(
        {
            "url",
            "stream",
            "group",
            "body_field",
            "claim_idle_seconds",
            "max_deliveries",
            "dead_letter_stream",
            "batch",
        }
    ),
    "mqtt": frozenset({"url", "topics", "client_id", "dead_letter_topic", "batch"}),
    "sqs": frozenset({"queue_url", "region", "endpoint_url", "dead_letter_queue_url", "batch"}),
    "pubsub": frozenset({"project", "subscription", "dead_letter_topic", "batch"}),
}
# Broker sources are consumed by ``flask consume`` (webhook_receiver.brokers),
# never received over HTTP, so they are kept apart from the webhook providers.
BROKER_PROVIDERS = frozenset(_BROKER_PROVIDER_KEYS)
_BROKER_DEFAULTS = {
    "rabbitmq": {"dedup_key": "property:message_id", "event_type": "property:type"},
    "nats": {"dedup_key": "header:Nats-Msg-Id", "event_type": "subject"},
    "redis": {"dedup_key": "field:message_id", "event_type": ""},
    "mqtt": {"dedup_key": "user_property:message-id", "event_type": "topic"},
}
# Where a Kafka source's offsets are kept: in the inbox, written in each
# batch's transaction, or committed to Kafka after it.
KAFKA_OFFSETS = ("inbox", "kafka")
# A source's SASL also signs in by token or Kerberos; a forward's only by password.
_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")
# Kafka's legal topic names (kafka.common.internals.Topic).
_KAFKA_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
# host:port, comma-separated (librdkafka's bootstrap.servers).
_KAFKA_SERVER = re.compile(r"^[A-Za-z0-9._\[\]:-]+:[0-9]{1,5}$")
_URL_SCHEMES = {
    "rabbitmq": ("amqp", "amqps"),
    "nats": ("nats", "tls"),
    "redis": ("redis", "rediss", "unix"),
    "mqtt": ("mqtt", "mqtts"),
}
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
    # Kafka: the topics consumed, the consumer group, where poison records and
    # conflicts are copied, and where the offsets are kept (KAFKA_OFFSETS).
    topics: tuple[str, ...] = ()
    group_id: str | None = None
    dead_letter_topic: str | None = None
    offsets: str = "inbox"
    # librdkafka's settings for the source's security (KAFKA_SECURITY_KEYS), the
    # SASL password among them: never shown.
    client_settings: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # Redis Streams (the stream in ``stream``, the consumer group in
    # ``group_id``): the entry field stored as the body (None: the whole
    # entry as JSON), how long an entry may stay pending with a consumer
    # before another claims it, how many deliveries make it poison, and
    # where conflicts and poison entries are copied.
    body_field: str | None = "body"
    claim_idle_seconds: int = 60
    max_deliveries: int = 5
    dead_letter_stream: str | None = None
    # MQTT (the topic filters in ``topics``, dead letters to
    # ``dead_letter_topic``): the persistent session's client id.
    client_id: str | None = None
    # SQS (the queue's URL in ``url``, its name in ``queue``): the region,
    # another endpoint (moto, LocalStack, ElasticMQ), the dead-letter queue.
    region: str | None = None
    endpoint_url: str | None = None
    dead_letter_queue_url: str | None = None
    # Pub/Sub (dead letters to ``dead_letter_topic``, a topic's full name):
    # the project and the subscription's full name.
    project: str | None = None
    subscription: str | None = None

    @property
    def safe_url(self) -> str:
        """The URL with its password redacted, for logs and pages."""
        return redact_url(self.url)

    def __repr__(self) -> str:
        where: Any = self.queue if self.provider == "rabbitmq" else self.stream
        if self.provider in ("kafka", "mqtt"):
            where = self.topics
        return (
            f"BrokerSourceConfig(name={self.name!r}, provider={self.provider!r}, "
            f"url={self.safe_url!r}, from={where!r})"
        )


def broker_source(name: str, table: dict[str, Any], path: str) -> BrokerSourceConfig:
    """Validate a broker source's table (its provider is one of ``BROKER_PROVIDERS``)."""
    where = f"{path}: [sources.{name}]"
    check_source_name(name, where)
    provider = table["provider"]
    unknown = set(table) - _BROKER_KEYS - _BROKER_PROVIDER_KEYS[provider]
    if unknown:
        raise ConfigError(
            f"{where} unknown key(s) for provider {provider}: {', '.join(sorted(unknown))}"
        )
    if provider == "kafka":
        return _kafka_source(name, table, where)
    if provider in ("sqs", "pubsub"):
        return cloud_queue_source(name, table, where)
    if provider in ("redis", "mqtt"):
        return _stream_source(name, table, where)
    url, specs = _url_and_specs(table, provider, where)
    size_key = "prefetch" if provider == "rabbitmq" else "batch"
    numbers = _positive_integers(table, {"retention_days": 30, size_key: 200}, where)
    batch = numbers[size_key]
    common: dict[str, Any] = {
        "name": name,
        "provider": provider,
        "url": url,
        "retention_days": numbers["retention_days"],
        **specs,
    }
    if provider == "rabbitmq":
        queue = table.get("queue")
        if not isinstance(queue, str) or not queue:
            raise ConfigError(f"{where} queue must name an existing queue")
        return BrokerSourceConfig(**common, batch=min(batch, 65535), queue=queue)
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
    if dead is not None and (not isinstance(dead, str) or not NATS_SUBJECT.match(dead)):
        raise ConfigError(f"{where} dead_letter_subject must be a subject without wildcards")
    if dead is not None and filter_subject is not None and subject_covers(filter_subject, dead):
        # The copy would land in the consumed stream and come straight back.
        raise ConfigError(
            f"{where} dead_letter_subject {dead!r} is inside filter_subject "
            f"{filter_subject!r}: the consumer would take its own dead letters; "
            "choose a subject outside it, in a stream of its own"
        )
    return BrokerSourceConfig(
        **common,
        batch=batch,
        stream=stream,
        durable=durable,
        filter_subject=filter_subject,
        dead_letter_subject=dead,
    )


def _url_and_specs(table: dict[str, Any], provider: str, where: str) -> tuple[str, dict[str, Any]]:
    """A RabbitMQ, NATS, Redis or MQTT source's url and its checked key and type specs."""
    url = table.get("url")
    if not isinstance(url, str) or url.partition("://")[0].lower() not in _URL_SCHEMES[provider]:
        schemes = " or ".join(f"{s}://" for s in _URL_SCHEMES[provider])
        raise ConfigError(f"{where} url must be a {schemes} URL")
    problem = url_problem(url)
    if problem:
        raise ConfigError(f"{where} url {problem}")
    specs = {key: table.get(key, default) for key, default in _BROKER_DEFAULTS[provider].items()}
    _check_specs(specs, provider, where)
    return url, specs


def _check_specs(specs: dict[str, Any], provider: str, where: str) -> None:
    """ConfigError unless each of ``specs`` (dedup_key, event_type) is one ``provider`` reads."""
    for key, spec in specs.items():
        try:
            parse_broker_spec(spec, provider, key)
        except ValueError as exc:
            raise ConfigError(f"{where} {key}: {exc}") from exc


def _topics(
    table: dict[str, Any], valid: Callable[[str], object], what: str, where: str
) -> list[str]:
    """A Kafka or MQTT source's ``topics``: ConfigError unless a non-empty list of ``what``."""
    topics = table.get("topics")
    if (
        not isinstance(topics, list)
        or not topics
        or not all(isinstance(t, str) and valid(t) for t in topics)
    ):
        raise ConfigError(f"{where} topics must be a non-empty list of {what}")
    return topics


def _positive_integers(
    table: dict[str, Any], defaults: dict[str, int], where: str
) -> dict[str, int]:
    """Each of ``defaults``' keys as ``table`` gives it (or its default): a positive integer.

    ConfigError for any other value (a bool too, which Python counts an int).
    """
    values = {key: table.get(key, default) for key, default in defaults.items()}
    for key, value in values.items():
        check_positive_integer(value, key, where, BROKER_MAXIMA)
    return values


# Each broker number's largest value, and why: past it, a cutoff date
# overflowed in flask purge, a wait overflowed threading's limit, or a
# driver refused the count. (Below it, each provider still takes no more
# than its own limit at once: RabbitMQ 65,535, Kafka 100,000, Redis 10,000.)
BROKER_MAXIMA: dict[str, tuple[int, str]] = {
    "retention_days": (CENTURY_DAYS, "a century: its cutoff stays a date"),
    "batch": (1_000_000, "confluent-kafka's consume() takes no more"),
    "prefetch": (1_000_000, "as a batch; RabbitMQ takes 65,535 at most"),
    "claim_idle_seconds": (7 * DAY, "1 week: a dead consumer's entries wait that long"),
    "max_deliveries": (1_000_000, "a limit that still ends a poison entry's rounds"),
}


def _kafka_source(name: str, table: dict[str, Any], where: str) -> BrokerSourceConfig:
    """Validate a Kafka source's table (the shape of docs/brokers.md's example)."""
    servers = table.get("bootstrap_servers")
    if not isinstance(servers, str) or not all(
        _KAFKA_SERVER.match(server.strip()) for server in servers.split(",")
    ):
        raise ConfigError(f"{where} bootstrap_servers must be 'host:port', comma-separated")
    if any(url_problem(f"kafka://{server.strip()}") for server in servers.split(",")):
        # librdkafka takes port 0 or 99999 and retries it for ever.
        raise ConfigError(
            f"{where} bootstrap_servers must be 'host:port', comma-separated, "
            "each port from 1 to 65535"
        )
    topics = _topics(table, _KAFKA_TOPIC.match, "Kafka topic names", where)
    group_id = table.get("group_id", f"webhook-receiver-{name}")
    if not isinstance(group_id, str) or not group_id.strip():
        raise ConfigError(f"{where} group_id must be a consumer group's name")
    if "dedup_key" not in table:
        raise ConfigError(
            f"{where} dedup_key is required: 'header:<name>', 'key', 'json:<pointer>' or 'offset'"
        )
    specs = {"dedup_key": table["dedup_key"], "event_type": table.get("event_type", "")}
    _check_specs(specs, "kafka", where)
    dead = table.get("dead_letter_topic")
    if dead is not None and (not isinstance(dead, str) or not _KAFKA_TOPIC.match(dead)):
        raise ConfigError(f"{where} dead_letter_topic must be a Kafka topic name")
    if dead is not None and dead in topics:
        # The copies would come straight back to the consumer.
        raise ConfigError(
            f"{where} dead_letter_topic {dead!r} is among topics: the consumer would take "
            "its own dead letters; choose a topic it does not consume"
        )
    offsets = table.get("offsets", "inbox")
    if offsets not in KAFKA_OFFSETS:
        raise ConfigError(f"{where} offsets must be 'inbox' or 'kafka'")
    numbers = _positive_integers(table, {"retention_days": 30, "batch": 500}, where)
    settings = []
    for key, setting in KAFKA_SECURITY_KEYS.items():
        value = table.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where} {key} must be a non-empty string")
        settings.append((setting, value))
    protocol = table.get("security_protocol", "PLAINTEXT")
    if protocol.upper() not in SECURITY_PROTOCOLS:
        raise ConfigError(
            f"{where} security_protocol must be one of {', '.join(SECURITY_PROTOCOLS)}"
        )
    mechanism = table.get("sasl_mechanism")
    if mechanism is not None and mechanism.upper() not in _SASL_MECHANISMS:
        raise ConfigError(f"{where} sasl_mechanism must be one of {', '.join(_SASL_MECHANISMS)}")
    if ("sasl_username" in table) != ("sasl_password" in table):
        raise ConfigError(f"{where} sasl_username and sasl_password go together")
    for key in ("sasl_password", "sasl_mechanism"):
        if key in table and not protocol.upper().startswith("SASL_"):
            # librdkafka would send no credentials at all, and the broker refuse every request.
            raise ConfigError(f"{where} {key} needs security_protocol SASL_SSL or SASL_PLAINTEXT")
    if "ssl_ca_location" in table and not protocol.upper().endswith("SSL"):
        # Without TLS librdkafka never reads it: the broker would go unchecked.
        raise ConfigError(f"{where} ssl_ca_location needs security_protocol SSL or SASL_SSL")
    return BrokerSourceConfig(
        name=name,
        provider="kafka",
        # What logs and pages show of where it consumes: no credential is in it.
        url="kafka://" + ",".join(server.strip() for server in servers.split(",")),
        dedup_key=specs["dedup_key"],
        event_type=specs["event_type"],
        batch=min(numbers["batch"], 100_000),
        retention_days=numbers["retention_days"],
        topics=tuple(topics),
        group_id=group_id,
        dead_letter_topic=dead,
        offsets=offsets,
        client_settings=tuple(settings),
    )


def _stream_source(name: str, table: dict[str, Any], where: str) -> BrokerSourceConfig:
    """Validate a Redis Streams or MQTT source's table (docs/brokers.md's examples)."""
    provider = table["provider"]
    url, specs = _url_and_specs(table, provider, where)
    defaults = {"retention_days": 30, "batch": 200 if provider == "redis" else 100}
    if provider == "redis":
        defaults.update(claim_idle_seconds=60, max_deliveries=5)
    values = _positive_integers(table, defaults, where)
    common: dict[str, Any] = {
        "name": name,
        "provider": provider,
        "url": url,
        "retention_days": values["retention_days"],
        "batch": min(values["batch"], 10_000),
        **specs,
    }
    if provider == "mqtt":
        return _mqtt_source(table, where, common)
    texts = {"stream": None, "group": "webhook-receiver", "body_field": "body"}
    stream, group, body_field = (table.get(key, default) for key, default in texts.items())
    for key, value in (("stream", stream), ("group", group)):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where} {key} must be a non-empty string")
    if not isinstance(body_field, str):
        raise ConfigError(f'{where} body_field must be a field\'s name, or "" for the whole entry')
    if body_field and f"field:{body_field}" in specs.values():
        raise ConfigError(
            f"{where} field {body_field!r} is the body (body_field): read it with json:<pointer>"
        )
    dead = table.get("dead_letter_stream")
    if dead is not None and (not isinstance(dead, str) or not dead or dead == stream):
        raise ConfigError(f"{where} dead_letter_stream must name a stream other than {stream!r}")
    return BrokerSourceConfig(
        **common,
        stream=stream,
        group_id=group,
        body_field=body_field or None,
        claim_idle_seconds=values["claim_idle_seconds"],
        max_deliveries=values["max_deliveries"],
        dead_letter_stream=dead,
    )


def _mqtt_source(table: dict[str, Any], where: str, common: dict[str, Any]) -> BrokerSourceConfig:
    topics = _topics(table, _mqtt_filter, "MQTT topic filters", where)
    client_id = table.get("client_id", f"webhook-receiver-{common['name']}")
    if not isinstance(client_id, str) or not client_id or "\x00" in client_id:
        raise ConfigError(f"{where} client_id must be a non-empty string")
    dead = table.get("dead_letter_topic")
    if dead is not None and (
        not isinstance(dead, str) or not _mqtt_filter(dead) or "+" in dead or "#" in dead
    ):
        raise ConfigError(f"{where} dead_letter_topic must be a topic name without wildcards")
    taken = [t for t in topics if dead is not None and mqtt_topic_matches(t, dead)]
    if taken:
        # The copies would come straight back to the consumer.
        raise ConfigError(
            f"{where} dead_letter_topic {dead!r} is inside topics ({taken[0]}): the consumer "
            "would take its own dead letters; choose a topic outside them"
        )
    return BrokerSourceConfig(
        **common, topics=tuple(topics), client_id=client_id, dead_letter_topic=dead
    )


def _mqtt_filter(text: str) -> bool:
    """Tell whether ``text`` is an MQTT topic filter: ``+`` a whole level, ``#`` the last."""
    if not text or "\x00" in text or len(text.encode()) > 65535:
        return False
    levels = text.split("/")
    for n, level in enumerate(levels):
        if ("+" in level and level != "+") or ("#" in level and level != "#"):
            return False
        if level == "#" and n != len(levels) - 1:
            return False
    return True


def mqtt_topic_matches(topic_filter: str, topic: str) -> bool:
    """Tell whether the broker delivers a message published on ``topic`` to ``topic_filter``."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False  # MQTT 5, 4.7.2: a $ topic is never matched by a leading wildcard
    wanted, given = topic_filter.split("/"), topic.split("/")
    for n, level in enumerate(wanted):
        if level == "#":
            return True
        if n >= len(given) or (level != "+" and level != given[n]):
            return False
    return len(wanted) == len(given)


# Redis Streams and MQTT name a value of their own in a spec: an entry's
# field, an MQTT 5 user property. Both are read as a NATS header is (the
# consumers hand them over as the BrokerMessage's headers); Redis's entry id
# as a property, and MQTT's topic as the subject.
_NAMED_SPECS = {"redis": "field", "mqtt": "user_property"}


def _named_spec(spec: Any, provider: str, key: str) -> tuple[str, str]:
    if not isinstance(spec, str):
        raise ValueError(f"{spec!r} is not a string")
    if provider == "redis" and spec == "id":
        if key != "dedup_key":
            raise ValueError("'id' (the entry id) is a dedup key of a Redis source only")
        return "property", "id"
    if provider == "mqtt" and spec == "topic":
        if key != "event_type":
            raise ValueError("'topic' is the event type of an MQTT source only")
        return "subject", ""
    if spec == "" and key == "event_type":
        return "property", ""  # no type: none is read, every event's type is none
    kind, sep, arg = spec.partition(":")
    prefix = _NAMED_SPECS[provider]
    if kind == prefix and sep and arg:
        return "header", arg
    if kind == "json":
        return parse_spec(spec)
    extra = " or 'id'" if provider == "redis" and key == "dedup_key" else ""
    extra += " or 'topic'" if provider == "mqtt" and key == "event_type" else ""
    raise ValueError(f"{spec!r} is not '{prefix}:<name>' or 'json:<pointer>'{extra}")


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

    ``property:<name>`` (RabbitMQ), ``header:<name>``, ``json:<pointer>``,
    ``subject`` (NATS, event type only), and Kafka's ``key`` and ``offset``
    (dedup key only) and ``topic`` (event type only).
    """
    if not isinstance(spec, str):
        raise ValueError(f"{spec!r} is not a string")
    if provider in _NAMED_SPECS:
        return _named_spec(spec, provider, key)
    if provider in ("sqs", "pubsub"):
        return cloud_queue_spec(spec, provider, key)
    if provider == "kafka" and spec in KAFKA_RECORD_SPECS:
        return _kafka_record_spec(spec, key)
    if provider == "kafka" and spec == "" and key == "event_type":
        # No type: a property no Kafka record has, so every record's type is none.
        return "property", ""
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


# Kafka's own parts of a record a spec may name, and which of dedup_key
# (key) or event_type (type) may name each. They are read as a RabbitMQ
# source's AMQP properties are: the Kafka consumer hands them over as the
# BrokerMessage's properties (the key as it was sent, the position as
# "<topic>/<partition>/<offset>") and the topic as its subject.
KAFKA_RECORD_SPECS = {"key": "key", "offset": "key", "topic": "type"}


def _kafka_record_spec(spec: str, key: str) -> tuple[str, str]:
    if (KAFKA_RECORD_SPECS[spec] == "key") != (key == "dedup_key"):
        role = "a dedup key" if KAFKA_RECORD_SPECS[spec] == "key" else "an event type"
        raise ValueError(f"{spec!r} is {role} of a Kafka source only")
    if spec == "topic":
        return "subject", ""
    return "property", spec


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


# -- SQS and Pub/Sub: cloud queues, settled per message -------------------------

# An SQS queue's name (a FIFO queue's ends in .fifo, within the 80).
_SQS_QUEUE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,75}(\.fifo)?$|^[A-Za-z0-9_-]{1,80}$")
_AWS_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-[0-9]+$")
# The region in an SQS endpoint's host name (sqs.eu-west-1.amazonaws.com).
_SQS_HOST_REGION = re.compile(r"^sqs\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?$")
# A Pub/Sub topic or subscription name (3 to 255, starting with a letter).
_PUBSUB_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9._~+%-]{2,254}$")
_PUBSUB_PROJECT = re.compile(r"^[a-z][a-z0-9:.-]{0,98}[a-z0-9]$")
# SQS's and Pub/Sub's batches: SQS receives 10 at a time, several per batch.
_DEFAULT_BATCH = {"sqs": 10, "pubsub": 200}
_MAX_BATCH = 1000


def cloud_queue_source(name: str, table: dict[str, Any], where: str) -> BrokerSourceConfig:
    """Validate an SQS or Pub/Sub source's table (the shapes in docs/brokers.md)."""
    provider = table["provider"]
    specs = {
        "dedup_key": table.get("dedup_key", "message_id"),
        "event_type": table.get("event_type", ""),
    }
    _check_specs(specs, provider, where)
    numbers = _positive_integers(
        table, {"retention_days": 30, "batch": _DEFAULT_BATCH[provider]}, where
    )
    if numbers["batch"] > _MAX_BATCH:
        raise ConfigError(f"{where} batch must be at most {_MAX_BATCH}")
    common: dict[str, Any] = {"name": name, "provider": provider, **numbers, **specs}
    if provider == "pubsub":
        return _pubsub_source(table, where, common)
    queue_url, queue = _sqs_queue_url(table.get("queue_url"), where, "queue_url")
    fifo = queue.endswith(".fifo")
    if specs["dedup_key"] == "deduplication_id" and not fifo:
        raise ConfigError(
            f"{where} dedup_key 'deduplication_id' is for FIFO queues (a name ending in .fifo)"
        )
    dead = table.get("dead_letter_queue_url") or None
    if dead is not None:
        dead, dead_name = _sqs_queue_url(dead, where, "dead_letter_queue_url")
        if dead == queue_url:
            raise ConfigError(f"{where} dead_letter_queue_url is the queue itself")
        if dead_name.endswith(".fifo") != fifo:
            # SQS's own rule: a queue and its dead-letter queue are of one type.
            raise ConfigError(
                f"{where} dead_letter_queue_url must be a "
                f"{'FIFO' if fifo else 'standard'} queue, as queue_url is"
            )
    endpoint = table.get("endpoint_url") or None
    if endpoint is not None and not _http_url(endpoint):
        raise ConfigError(f"{where} endpoint_url must be an http:// or https:// URL")
    region = table.get("region")
    if region is None:
        found = _SQS_HOST_REGION.match(urlsplit(queue_url).hostname or "")
        region = found.group(1) if found else None
    if not isinstance(region, str) or not _AWS_REGION.match(region):
        raise ConfigError(f"{where} region must be an AWS region (eu-west-1)")
    return BrokerSourceConfig(
        url=queue_url,
        queue=queue,
        region=region,
        endpoint_url=endpoint,
        dead_letter_queue_url=dead,
        **common,
    )


def _pubsub_source(table: dict[str, Any], where: str, common: dict[str, Any]) -> BrokerSourceConfig:
    project = table.get("project")
    if not isinstance(project, str) or not _PUBSUB_PROJECT.match(project):
        raise ConfigError(f"{where} project must be a Google Cloud project id")
    subscription = _pubsub_path(table.get("subscription"), project, "subscriptions")
    if subscription is None:
        raise ConfigError(f"{where} subscription must name an existing subscription")
    dead = table.get("dead_letter_topic") or None
    if dead is not None:
        dead = _pubsub_path(dead, project, "topics")
        if dead is None:
            raise ConfigError(f"{where} dead_letter_topic must be a topic's name")
    return BrokerSourceConfig(
        url=f"pubsub://{subscription}",
        project=project,
        subscription=subscription,
        dead_letter_topic=dead,
        **common,
    )


def _pubsub_path(value: Any, project: str, kind: str) -> str | None:
    """A topic's or subscription's full name, from its name or full name; None if neither."""
    if not isinstance(value, str):
        return None
    prefix, _, name = value.rpartition("/")
    if prefix and not re.match(rf"^projects/[^/]+/{kind}$", prefix):
        return None
    if not _PUBSUB_NAME.match(name) or name.startswith("goog"):
        return None
    return value if prefix else f"projects/{project}/{kind}/{name}"


def _sqs_queue_url(value: Any, where: str, key: str) -> tuple[str, str]:
    """An SQS queue's URL and name, or ConfigError."""
    parts = _split(value)
    name = parts.path.rstrip("/").rpartition("/")[2] if parts else ""
    if (
        parts is None
        or not _http_url(value)
        or parts.query
        or parts.fragment
        or not _SQS_QUEUE_NAME.match(name)
    ):
        raise ConfigError(
            f"{where} {key} must be a queue's URL "
            "(https://sqs.<region>.amazonaws.com/<account>/<name>)"
        )
    return value, name


def _split(value: Any) -> SplitResult | None:
    """``value`` split as a URL; None for no string, or one urllib refuses (a '[', a bad port)."""
    if not isinstance(value, str) or url_problem(value):
        return None
    return urlsplit(value)


def _http_url(value: Any) -> bool:
    parts = _split(value)
    # Credentials come from the AWS chain, never from a URL.
    return (
        parts is not None
        and parts.scheme in ("http", "https")
        and bool(parts.hostname)
        and "@" not in parts.netloc
    )


def cloud_queue_spec(spec: Any, provider: str, key: str) -> tuple[str, str]:
    """An SQS or Pub/Sub source's key or type spec as kind and argument (ValueError).

    ``message_id`` (the id the broker gave the message when it was sent, the
    same on every redelivery) and, on SQS FIFO queues, ``deduplication_id``
    are read as a RabbitMQ source's properties are: the consumer hands them
    over as the BrokerMessage's properties. ``attribute:<name>`` reads a
    message attribute, handed over as its headers. An empty event type is
    none.
    """
    if not isinstance(spec, str):
        raise ValueError(f"{spec!r} is not a string")
    if spec == "" and key == "event_type":
        return "property", ""
    own = ("message_id", "deduplication_id") if provider == "sqs" else ("message_id",)
    if spec in own:
        if key != "dedup_key":
            raise ValueError(f"{spec!r} is a dedup key, not an event type")
        return "property", spec
    kind, sep, arg = spec.partition(":")
    if kind == "attribute" and sep and arg.strip():
        return "header", arg
    if kind == "json":
        return parse_spec(spec)
    shown = ", ".join(f"'{name}'" for name in own)
    raise ValueError(f"{spec!r} is not {shown}, 'attribute:<name>' or 'json:<pointer>'")
