"""Broker sources: the ``[sources.<name>]`` tables consumed by ``flask consume``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .forwards import NATS_SUBJECT, PROCESSING_KEYS
from .settings import ConfigError, redact_url
from .sources import check_source_name, parse_spec

_BROKER_KEYS = {"provider", "url", "dedup_key", "event_type", "retention_days", *PROCESSING_KEYS}
# Each broker's table: the keys only it reads. Its names are the brokers a
# source may name (brokers.runner.ADAPTERS has one consumer for each).
_BROKER_PROVIDER_KEYS = {
    "rabbitmq": frozenset({"queue", "prefetch"}),
    "nats": frozenset({"stream", "durable", "filter_subject", "dead_letter_subject", "batch"}),
}
# Broker sources are consumed by ``flask consume`` (webhook_receiver.brokers),
# never received over HTTP, so they are kept apart from the webhook providers.
BROKER_PROVIDERS = frozenset(_BROKER_PROVIDER_KEYS)
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
