"""``flask --app wsgi brokers``: declare what the broker sources name, and publish to them.

``consume`` never declares a queue or a stream: their owner chooses their
settings. These commands are that owner's shortcut on a machine that has
nothing but the brokers (no ``rabbitmqadmin``, no ``nats`` CLI):

- ``declare [SOURCE ...]`` makes, idempotently, what the config names: a
  RabbitMQ queue, its dead-letter exchange (``<queue>.dlx``) and the queue
  that exchange feeds (``<queue>.dead``); a JetStream stream taking the
  source's ``filter_subject`` and a stream for its ``dead_letter_subject``
  (``<stream>_DEAD``, unless a stream takes that subject already). A
  dead-letter subject the source's own stream would take is refused.
- ``publish SOURCE --key K [--type T] BODY`` sends one message that the
  source's ``dedup_key`` and ``event_type`` specs read back as K and T.

Each thing declared or published is one line; any failure is one line too.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import click
import nats
import nats.errors
import nats.js.errors
import pika
import pika.exceptions
from flask import current_app
from flask.cli import with_appcontext
from nats.js.api import RetentionPolicy, StreamConfig

from ..config import BrokerSourceConfig, FileConfig, parse_broker_spec, subject_covers
from ..outbox.ordering import resolve_pointer
from .cloud_setup import (
    declare_pubsub,
    declare_sqs,
    key_and_type_specs,
    place,
    publish_pubsub,
    publish_sqs,
    read_body,
)
from .mqtt_setup import declare_mqtt, declare_mqtt_dead_letters, publish_mqtt
from .redis_setup import declare_redis, publish_redis

# A quorum queue's requeues count towards its delivery limit on RabbitMQ 4.0
# to 4.2 (20 by default), and the consumer requeues once per back-off while
# the database is away: this rides out days of outage at the 30 s back-off
# cap (docs/brokers.md, "Quorum queues and their delivery limit").
DELIVERY_LIMIT = 10_000
_NOT_FOUND = 404
_AMQP_ERRORS = (pika.exceptions.AMQPError, OSError)
_NATS_ERRORS = (nats.errors.Error, OSError, asyncio.TimeoutError)
# AMQP properties that are numbers on the wire.
_INT_PROPERTIES = frozenset({"priority", "delivery_mode"})


@dataclass
class Outgoing:
    """What a publish sets besides the body: AMQP properties, headers, a NATS subject."""

    properties: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    subject: str | None = None
    content_type: str | None = None
    # Where the key and type travel, for the command's line.
    shown_parts: list[str] = field(default_factory=list)

    def shown(self) -> str:
        """Where the key and type travel, for the command's line."""
        return ", ".join(self.shown_parts) or "no key or type set"


def dead_letter_exchange(queue: str) -> str:
    """The name ``declare`` gives a queue's dead-letter exchange."""
    return f"{queue}.dlx"


def dead_letter_queue(queue: str) -> str:
    """The name ``declare`` gives the queue a queue's dead letters land in."""
    return f"{queue}.dead"


def dead_letter_stream(stream: str) -> str:
    """The name ``declare`` gives a new stream for a source's dead-letter subject."""
    return f"{stream}_DEAD"


@click.group("brokers")
def brokers_group() -> None:
    """Declare the broker sources' queues and streams, or publish a test message."""


@brokers_group.command("declare")
@click.argument("sources", nargs=-1)
@click.option(
    "--queue-type",
    type=click.Choice(["quorum", "classic"]),
    default="quorum",
    show_default=True,
    help="The type of the RabbitMQ queues declared.",
)
@with_appcontext
def declare_command(sources: tuple[str, ...], queue_type: str) -> None:
    """Declare the queues, exchanges and streams the named broker sources (all by default) use."""
    failed = 0
    for source in _chosen(sources):
        if source.provider == "kafka" and not sources:
            # Asked for every source, a Kafka one is said and passed over: a
            # release step that declares them all must not fail on it.
            _say(source.name, f"a kafka source, not declared here: make {_KAFKA_TOPICS}")
            continue
        # One source's failure is its line: the others are declared all the
        # same, and the exit status says that something failed.
        try:
            _declare(source, queue_type)
        except click.ClickException as exc:
            exc.show()
            failed += 1
    if failed:
        raise SystemExit(1)


def _declare(source: BrokerSourceConfig, queue_type: str) -> None:
    say = functools.partial(_say, source.name)
    if source.provider == "rabbitmq":
        declare_rabbitmq(source, say, queue_type)
    elif source.provider == "redis":
        declare_redis(source, say)
    elif source.provider == "mqtt":
        declare_mqtt(source, say)
        declare_mqtt_dead_letters(source, say)
    elif source.provider == "sqs":
        declare_sqs(source, say)
    elif source.provider == "pubsub":
        declare_pubsub(source, say)
    elif source.provider == "nats":
        asyncio.run(declare_jetstream(source, say))
    else:
        raise _not_here(source, _KAFKA_TOPICS)


# Kafka's topics are made with its own tools: the one broker declare leaves alone.
_KAFKA_TOPICS = "its topics with Kafka's own tools (kafka-topics.sh --create)"


def _say(name: str, line: str) -> None:
    click.echo(f"{name}: {line}")


@brokers_group.command("publish")
@click.argument("source_name", metavar="SOURCE")
@click.argument("body")
@click.option("--key", help="The dedup key, set where the source's dedup_key reads it.")
@click.option("--type", "event_type", help="The event type, set where event_type reads it.")
@click.option(
    "--subject",
    help="NATS: the subject, MQTT: the topic (default: the one the source takes, if literal).",
)
@click.option("--content-type", help="Default: application/json for a JSON body, else none.")
@with_appcontext
def publish_command(
    source_name: str,
    body: str,
    key: str | None,
    event_type: str | None,
    subject: str | None,
    content_type: str | None,
) -> None:
    """Publish BODY to a broker source, carrying KEY and TYPE where its specs read them."""
    (source,) = _chosen((source_name,))
    if source.provider == "kafka":
        raise _not_here(source, "its records with Kafka's own tools (kafka-console-producer.sh)")
    data = body.encode()
    cloud = {"sqs": publish_sqs, "pubsub": publish_pubsub}.get(source.provider)
    if cloud is not None:  # a message_id key is the broker's to give: their own placing
        placed = place(source, data, key, event_type, content_type)
        click.echo(f"{source.name}: {cloud(source, data, placed)}")
        return
    message = _message(source, data, key, event_type, content_type)
    if source.provider == "rabbitmq":
        line = publish_rabbitmq(source, data, message)
    elif source.provider == "redis":
        line = publish_redis(
            source, data, message.headers, message.properties, message.content_type, message.shown()
        )
    elif source.provider == "mqtt":
        topic = message.subject or subject
        line = publish_mqtt(
            source, data, message.headers, message.content_type, topic, message.shown()
        )
    else:
        line = asyncio.run(publish_jetstream(source, data, message, subject))
    click.echo(f"{source.name}: {line}")


def _not_here(source: BrokerSourceConfig, what: str) -> click.ClickException:
    # Never another broker's path: a Kafka source is not declared or published to here yet.
    return click.ClickException(f"{source.name}: a {source.provider} source: make {what}")


def _chosen(names: tuple[str, ...]) -> list[BrokerSourceConfig]:
    config: FileConfig = current_app.config["FILE_CONFIG"]
    if not config.brokers:
        raise click.ClickException(f"{config.path}: no broker source")
    for name in names:
        if name not in config.brokers:
            known = ", ".join(sorted(config.brokers))
            raise click.ClickException(f"no broker source named {name!r} (there are: {known})")
    return [config.brokers[name] for name in names or config.brokers]


def _fail(source: BrokerSourceConfig, problem: str) -> click.ClickException:
    return click.ClickException(f"source {source.name}: {problem}")


def _describe(exc: BaseException) -> str:
    # pika's connection errors nest their cause in their repr; keep one line.
    name, text = type(exc).__name__, " ".join((str(exc) or repr(exc)).split())
    return text if text.startswith(name) else f"{name}: {text}"


# -- RabbitMQ -----------------------------------------------------------------


@contextmanager
def _amqp(source: BrokerSourceConfig, purpose: str) -> Iterator[Any]:
    params = pika.URLParameters(source.url)
    params.client_properties = {
        "connection_name": f"webhook-receiver brokers {purpose} {source.name} pid {os.getpid()}"
    }
    try:
        connection = pika.BlockingConnection(params)
    except _AMQP_ERRORS as exc:
        raise _fail(
            source, f"cannot reach RabbitMQ at {source.safe_url}: {_describe(exc)}"
        ) from exc
    try:
        yield connection
    except _AMQP_ERRORS as exc:
        raise _fail(source, f"RabbitMQ at {source.safe_url}: {_describe(exc)}") from exc
    finally:
        if connection.is_open:
            try:
                connection.close()
            except _AMQP_ERRORS:
                pass


def _amqp_step(
    connection: Any,
    source: BrokerSourceConfig,
    what: str,
    check: Callable[[Any], Any],
    declare: Callable[[Any], Any],
) -> str:
    """Declare one thing on a channel of its own: created, or exists (with these settings)."""
    probe = connection.channel()
    try:
        check(probe)  # passive: a 404 closes the channel, so it is a channel of its own
        existed = True
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code != _NOT_FOUND:
            raise _fail(source, f"{what}: {exc.reply_text}") from exc
        existed = False
    if probe.is_open:
        probe.close()
    channel = connection.channel()
    try:
        declare(channel)
    except pika.exceptions.ChannelClosedByBroker as exc:
        raise _other_settings(source, what, exc) from exc
    channel.close()
    return f"{what}: {'exists' if existed else 'created'}"


def _other_settings(
    source: BrokerSourceConfig, what: str, exc: pika.exceptions.ChannelClosedByBroker
) -> click.ClickException:
    # PRECONDITION_FAILED: it exists with other arguments, named in the reply.
    return _fail(
        source,
        f"{what} exists with other settings ({exc.reply_text}); "
        "delete it, or change the source's queue",
    )


def _same_if_there(
    connection: Any,
    source: BrokerSourceConfig,
    what: str,
    check: Callable[[Any], Any],
    declare: Callable[[Any], Any],
) -> None:
    """Refuse what exists with other arguments, before anything is made for it."""
    channel = connection.channel()
    try:
        check(channel)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == _NOT_FOUND:
            return
        raise _fail(source, f"{what}: {exc.reply_text}") from exc
    try:
        declare(channel)  # with the arguments it has, this changes nothing
    except pika.exceptions.ChannelClosedByBroker as exc:
        raise _other_settings(source, what, exc) from exc
    channel.close()


def declare_rabbitmq(
    source: BrokerSourceConfig, say: Callable[[str], None], queue_type: str = "quorum"
) -> None:
    """Declare the source's dead-letter exchange and queue, then its queue; one line each."""
    queue = source.queue or ""
    dlx, dead = dead_letter_exchange(queue), dead_letter_queue(queue)
    typed: dict[str, Any] = {"x-queue-type": queue_type}
    arguments = {**typed, "x-dead-letter-exchange": dlx}
    if queue_type == "quorum":
        arguments["x-delivery-limit"] = DELIVERY_LIMIT
    shown = f"queue {queue!r} ({queue_type}, dead letters to {dlx!r})"
    with _amqp(source, "declare") as connection:
        # A queue that refuses these arguments would leave the dead-letter
        # exchange and queue made for it feeding nothing.
        _same_if_there(
            connection,
            source,
            shown,
            lambda ch: ch.queue_declare(queue, passive=True),
            lambda ch: ch.queue_declare(queue, durable=True, arguments=arguments),
        )
        say(
            _amqp_step(
                connection,
                source,
                f"exchange {dlx!r} (fanout)",
                lambda ch: ch.exchange_declare(dlx, passive=True),
                lambda ch: ch.exchange_declare(dlx, "fanout", durable=True),
            )
        )
        say(
            _amqp_step(
                connection,
                source,
                f"queue {dead!r} ({queue_type}, bound to {dlx!r})",
                lambda ch: ch.queue_declare(dead, passive=True),
                lambda ch: _bound_queue(ch, dead, typed, dlx),
            )
        )
        say(
            _amqp_step(
                connection,
                source,
                shown,
                lambda ch: ch.queue_declare(queue, passive=True),
                lambda ch: ch.queue_declare(queue, durable=True, arguments=arguments),
            )
        )


def _bound_queue(channel: Any, queue: str, arguments: dict[str, Any], exchange: str) -> None:
    channel.queue_declare(queue, durable=True, arguments=arguments)
    channel.queue_bind(queue, exchange)


def publish_rabbitmq(source: BrokerSourceConfig, body: bytes, message: Outgoing) -> str:
    """Publish to the source's queue through the default exchange and wait for the confirm."""
    queue = source.queue or ""
    properties = pika.BasicProperties(
        delivery_mode=pika.DeliveryMode.Persistent,
        content_type=message.content_type,
        headers=message.headers or None,
        **message.properties,
    )
    with _amqp(source, "publish") as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        try:
            channel.basic_publish("", queue, body, properties, mandatory=True)
        except pika.exceptions.UnroutableError as exc:
            raise _fail(
                source,
                f"queue {queue!r} does not exist on {source.safe_url}: "
                f"run `flask --app wsgi brokers declare {source.name}` first",
            ) from exc
        except pika.exceptions.NackError as exc:
            raise _fail(source, f"RabbitMQ refused the message (nack): {exc}") from exc
        channel.close()
    return f"published to queue {queue!r} (confirmed): {message.shown()}"


# -- NATS JetStream -------------------------------------------------------------


async def _nats(source: BrokerSourceConfig) -> Any:
    errors: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)  # nats-py would log each with its traceback

    try:
        # Each server tried twice at most: nats-py's max_reconnect_attempts
        # also bounds its first connect, where 0 would mean forever.
        return await asyncio.wait_for(
            nats.connect(
                source.url,
                name=f"webhook-receiver brokers {source.name} pid {os.getpid()}",
                connect_timeout=2,
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0.2,
                error_cb=on_error,
            ),
            timeout=10,
        )
    except _NATS_ERRORS as exc:
        cause = _describe(errors[-1]) if errors else _describe(exc)
        raise _fail(source, f"cannot reach NATS at {source.safe_url}: {cause}") from exc


async def declare_jetstream(source: BrokerSourceConfig, say: Callable[[str], None]) -> None:
    """Declare the source's stream and its dead-letter stream; one line each."""
    nc = await _nats(source)
    try:
        await _declare_streams(source, nc.jetstream(), say)
    except nats.js.errors.APIError as exc:
        raise _fail(source, f"JetStream refused: {exc.description or exc}") from exc
    except _NATS_ERRORS as exc:
        raise _fail(source, f"JetStream at {source.safe_url}: {_describe(exc)}") from exc
    finally:
        await nc.close()


async def _declare_streams(source: BrokerSourceConfig, js: Any, say: Callable[[str], None]) -> None:
    stream = source.stream or ""
    info = await _stream_info(js, stream)
    subjects = list(info.config.subjects or []) if info else []
    wanted = source.filter_subject
    if wanted is None and info is None:
        # Made without subjects, a stream takes its own name as its one subject.
        wanted = stream
    if wanted is not None and not any(subject_covers(taken, wanted) for taken in subjects):
        subjects.append(wanted)
    dead = source.dead_letter_subject
    captured = [taken for taken in subjects if dead and subject_covers(taken, dead)]
    if dead and captured:
        # The copies would land in the stream they came from: consumed and
        # acknowledged there, while no dead-letter stream ever gets them.
        raise _fail(
            source,
            f"dead_letter_subject {dead!r} is taken by stream {stream!r} ({captured[0]}), "
            "the source's own: choose a subject outside it",
        )
    if dead:
        try:
            name = await js.find_stream_name_by_subject(dead)
        except nats.js.errors.NotFoundError:
            name = dead_letter_stream(stream)
        held = await _stream_info(js, name)
        if (
            held is not None
            and held.config.retention == RetentionPolicy.INTEREST
            and not held.state.consumer_count
        ):
            # It keeps a message only for the consumers there are: none.
            raise _fail(
                source,
                f"stream {name!r}, which takes dead_letter_subject {dead!r}, has interest "
                "retention and no consumer: it would drop every dead letter; give it a "
                "consumer, or give the subject a stream with limits retention",
            )
    say(await _put_stream(js, stream, info, subjects))
    if dead:
        taken = list(held.config.subjects or []) if held else []
        if not any(subject_covers(subject, dead) for subject in taken):
            taken.append(dead)
        say(await _put_stream(js, name, held, taken))


async def _stream_info(js: Any, name: str) -> Any:
    try:
        return await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        return None


async def _put_stream(js: Any, name: str, info: Any, subjects: list[str]) -> str:
    """Create the stream, or add subjects to it; a line saying which."""
    shown = f"stream {name!r} ({', '.join(subjects)})"
    if info is None:
        await js.add_stream(StreamConfig(name=name, subjects=subjects))
        return f"{shown}: created"
    if list(info.config.subjects or []) == subjects:
        return f"{shown}: exists"
    await js.update_stream(replace(info.config, subjects=subjects))
    return f"{shown}: updated"


async def publish_jetstream(
    source: BrokerSourceConfig, body: bytes, message: Outgoing, subject: str | None
) -> str:
    """Publish to a subject the source's stream and filter take; wait for the PubAck."""
    headers = dict(message.headers)
    if message.content_type:
        headers.setdefault("Content-Type", message.content_type)
    nc = await _nats(source)
    try:
        js = nc.jetstream()
        subject = await _subject(source, js, message, subject)
        ack = await js.publish(subject, body, headers=headers or None, timeout=5)
    except nats.js.errors.NoStreamResponseError as exc:
        raise _fail(
            source,
            f"no stream takes subject {subject!r}: "
            f"run `flask --app wsgi brokers declare {source.name}` first",
        ) from exc
    except _NATS_ERRORS as exc:
        raise _fail(source, f"JetStream at {source.safe_url}: {_describe(exc)}") from exc
    finally:
        await nc.close()
    if ack.stream != source.stream:
        raise _fail(
            source,
            f"subject {subject!r} went to stream {ack.stream!r}, "
            f"not the source's {source.stream!r}",
        )
    where = f"published to {subject} (stream {ack.stream!r}, sequence {ack.seq})"
    if ack.duplicate:
        # JetStream keeps the first message with this Nats-Msg-Id.
        where = f"stream {ack.stream!r} dropped it as a duplicate (within its duplicate window)"
    return f"{where}: {message.shown()}"


async def _subject(
    source: BrokerSourceConfig, js: Any, message: Outgoing, given: str | None
) -> str:
    """The subject to publish on: the type (if it is the subject), --subject, or the only one."""
    if message.subject is not None:
        if given is not None and given != message.subject:
            raise click.UsageError(
                f"source {source.name}'s event type is the subject: give --type or --subject"
            )
        given = message.subject
    if source.filter_subject is not None:
        takes = [source.filter_subject]
    else:
        info = await _stream_info(js, source.stream or "")
        takes = list(info.config.subjects or []) if info else [source.stream or ""]
    if given is None:
        literal = [subject for subject in takes if not _wild(subject)]
        if len(takes) != 1 or not literal:
            option = "--type" if _type_kind(source) == "subject" else "--subject"
            raise click.UsageError(
                f"give {option}: a subject that {', '.join(takes)} takes, to publish on"
            )
        given = literal[0]
    if not given or _wild(given):
        raise click.UsageError(f"{given!r} is not a subject to publish on (no wildcards)")
    if not any(subject_covers(subject, given) for subject in takes):
        raise click.UsageError(
            f"subject {given!r} is outside {', '.join(takes)}, "
            f"what source {source.name} consumes: it would never see the message"
        )
    return given


def _wild(subject: str) -> bool:
    return any(token in ("*", ">") for token in subject.split("."))


def _type_kind(source: BrokerSourceConfig) -> str:
    return parse_broker_spec(source.event_type, source.provider, "event_type")[0]


# -- the message: where the source's specs read the key and type -----------------


def _message(
    source: BrokerSourceConfig,
    body: bytes,
    key: str | None,
    event_type: str | None,
    content_type: str | None,
) -> Outgoing:
    message = Outgoing()
    parsed, is_json, message.content_type = read_body(body, content_type)
    for name, spec, value, kind, arg, option in key_and_type_specs(source, key, event_type):
        if kind == "json":
            carried = _from_body(source, name, spec, parsed if is_json else None, arg, value)
            if carried is not None:
                message.shown_parts.append(f"{name} {carried!r} at {spec}")
            continue
        if value is None:
            if name == "dedup_key":
                raise click.UsageError(
                    f"give --key: source {source.name} reads its dedup key from {spec}"
                )
            continue
        if kind == "subject":
            message.subject = value  # shown as where it was published
            continue
        if kind == "property":
            message.properties[arg] = _property(arg, value, option)
        else:
            message.headers[arg] = value
        message.shown_parts.append(f"{arg} {value!r}")
    return message


def _from_body(
    source: BrokerSourceConfig,
    name: str,
    spec: str,
    parsed: Any,
    pointer: str,
    given: str | None,
) -> str | None:
    """The value a ``json:`` spec reads from the body, checked against the option given."""
    value = None
    if parsed is not None:
        found = resolve_pointer(parsed, pointer) if pointer else parsed
        if found is not None and not isinstance(found, dict | list):
            value = ("true" if found else "false") if isinstance(found, bool) else str(found)
    what = "dedup key" if name == "dedup_key" else "event type"
    if value is None and (name == "dedup_key" or given is not None):
        raise click.UsageError(
            f"source {source.name} reads its {what} from the body ({spec}): "
            f"the body must carry it there as a JSON string or number"
        )
    if given is not None and given != value:
        raise click.UsageError(
            f"source {source.name} reads its {what} from the body ({spec}), "
            f"which holds {value!r}, not {given!r}: change the body, not the option"
        )
    return value


def _property(name: str, value: str, option: str) -> Any:
    if name not in _INT_PROPERTIES:
        return value
    try:
        return int(value)
    except ValueError:
        raise click.UsageError(f"{option}: the AMQP property {name} is a number") from None
