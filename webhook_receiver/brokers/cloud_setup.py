"""``flask brokers declare`` and ``publish`` for SQS and Pub/Sub sources.

``declare`` makes, idempotently, what the source names: on SQS its
dead-letter queue and its queue (FIFO ones when the name ends in
``.fifo``), with no redrive policy of their own (the consumer dead-letters
what it cannot store; a ``maxReceiveCount`` would move messages never
stored past a long database outage); on Pub/Sub the dead-letter topic and
a subscription of the same name on it (Pub/Sub keeps no message a topic
has no subscription for), then the subscription, on a topic of its name
when it does not exist yet.

``publish`` sends one message whose attributes (or body) carry the key
and type where the source's specs read them: a ``message_id`` key is the
id the broker gives the message, printed, never chosen; a
``deduplication_id`` key is the FIFO message's deduplication id.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.exceptions
import click
import google.api_core.exceptions as api_exceptions
import google.auth.exceptions
from google.api_core import retry as api_retry
from google.cloud import pubsub_v1

from .. import pointers
from ..config import BrokerSourceConfig, parse_broker_spec
from ..fingerprint import JSONError, loads
from .pubsub import publish_exactly

_AWS_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError)
_GOOGLE_ERRORS = (api_exceptions.GoogleAPIError, OSError)
_NO_QUEUE = frozenset(
    {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist", "NonExistentQueue"}
)
# The message group of a FIFO message this command sends (one group: in order).
FIFO_GROUP = "webhook-receiver"
# The ack deadline of a subscription declare makes: the consumer extends it
# for a batch that takes longer.
ACK_DEADLINE_SECONDS = 60
# Google's default retry of a call goes on for 60 s: a Pub/Sub that is
# away is said to be within the command's own 10 s.
_RETRY = api_retry.Retry(
    predicate=api_retry.if_exception_type(
        api_exceptions.Aborted, api_exceptions.ServiceUnavailable, api_exceptions.Unknown
    ),
    initial=0.1,
    maximum=2.0,
    timeout=10.0,
)
# The topic Pub/Sub names for a subscription whose topic was deleted.
_DELETED_TOPIC = "_deleted-topic_"


def _fail(source: BrokerSourceConfig, problem: str) -> click.ClickException:
    return click.ClickException(f"source {source.name}: {problem}")


def _describe(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _not_declared(source: BrokerSourceConfig, what: str) -> click.ClickException:
    return _fail(
        source, f"{what} does not exist: run `flask --app wsgi brokers declare {source.name}` first"
    )


# -- SQS ------------------------------------------------------------------------------


def _sqs(source: BrokerSourceConfig) -> Any:
    return boto3.session.Session().client(
        "sqs", region_name=source.region, endpoint_url=source.endpoint_url
    )


def declare_sqs(source: BrokerSourceConfig, say: Callable[[str], None]) -> None:
    """Create the source's dead-letter queue, then its queue; one line each."""
    client = _sqs(source)
    wanted = [source.dead_letter_queue_url, source.url]
    for url in [u for u in wanted if u]:
        name = urlsplit(url).path.rstrip("/").rpartition("/")[2]
        attributes = {"FifoQueue": "true"} if name.endswith(".fifo") else {}
        shown = f"queue {name!r}{' (FIFO)' if attributes else ''}"
        try:
            held = _sqs_attributes(client, url)
            made = client.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
        except botocore.exceptions.ClientError as exc:
            raise _fail(source, f"{shown}: {_aws_error(exc, 'Message')}") from exc
        except _AWS_ERRORS as exc:
            raise _fail(source, f"SQS at {_where(source)}: {_describe(exc)}") from exc
        if made.rstrip("/") != url.rstrip("/"):
            raise _fail(
                source,
                f"{shown} is {made} on {_where(source)}, not {url}: "
                "correct the source's URL (or its region and endpoint_url)",
            )
        say(f"{shown}: {'created' if held is None else 'exists' + _redrive(held)}")


def _sqs_attributes(client: Any, url: str) -> dict[str, str] | None:
    """The queue's ARN and redrive policy; None when it does not exist."""
    try:
        response = client.get_queue_attributes(
            QueueUrl=url, AttributeNames=["QueueArn", "RedrivePolicy"]
        )
    except botocore.exceptions.ClientError as exc:
        if _aws_error(exc, "Code") in _NO_QUEUE:
            return None
        raise
    return dict(response.get("Attributes") or {})


def _redrive(attributes: dict[str, str]) -> str:
    """What a redrive policy made elsewhere does, for the line (declare sets none)."""
    try:
        policy = json.loads(attributes["RedrivePolicy"])
        count, target = policy["maxReceiveCount"], str(policy["deadLetterTargetArn"])
    except (KeyError, TypeError, ValueError):
        return ""
    # Every receive counts, the consumer's once per back-off while the
    # database is away: a low count moves messages never stored.
    return (
        f"; its redrive policy moves a message received {count} times to "
        f"{target.rpartition(':')[2]!r}, a database outage's receives too: "
        "raise maxReceiveCount far above the outages to ride out"
    )


def _where(source: BrokerSourceConfig) -> str:
    return source.endpoint_url or source.region or "AWS"


def _aws_error(exc: botocore.exceptions.ClientError, field: str) -> Any:
    """The ``Code`` or ``Message`` of the error an AWS service answered with."""
    return exc.response.get("Error", {}).get(field)


def publish_sqs(source: BrokerSourceConfig, body: bytes, placed: Placed) -> str:
    """Send one message to the source's queue; the line to print (its MessageId)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise click.UsageError("SQS carries text bodies only (UTF-8)") from None
    request: dict[str, Any] = {"QueueUrl": source.url, "MessageBody": text}
    if placed.attributes:
        request["MessageAttributes"] = {
            name: {"DataType": "String", "StringValue": value}
            for name, value in placed.attributes.items()
        }
    if (source.queue or "").endswith(".fifo"):
        request["MessageGroupId"] = FIFO_GROUP
        if placed.deduplication_id is not None:
            request["MessageDeduplicationId"] = placed.deduplication_id
    client = _sqs(source)
    try:
        sent = client.send_message(**request)
    except botocore.exceptions.ClientError as exc:
        if _aws_error(exc, "Code") in _NO_QUEUE:
            raise _not_declared(source, f"queue {source.url}") from exc
        raise _fail(source, f"SQS refused the message: {_describe(exc)}") from exc
    except _AWS_ERRORS as exc:
        raise _fail(source, f"cannot reach SQS at {_where(source)}: {_describe(exc)}") from exc
    shown = placed.shown(sent["MessageId"])
    return f"sent to queue {source.queue!r} (MessageId {sent['MessageId']}): {shown}"


# -- Pub/Sub ----------------------------------------------------------------------------


def declare_pubsub(source: BrokerSourceConfig, say: Callable[[str], None]) -> None:
    """Create the dead-letter topic (and its subscription), then the subscription; a line each."""
    with _pubsub_clients(source) as (publisher, subscriber):
        dead = source.dead_letter_topic
        if dead:
            say(_put_topic(publisher, dead))
            keeper = dead.replace("/topics/", "/subscriptions/", 1)
            line = _put_subscription(subscriber, keeper, dead, "keeps the dead letters")
            # One of that name on another topic keeps none of them.
            held = subscriber.get_subscription(subscription=keeper, retry=_RETRY, timeout=10).topic
            if held != dead:
                raise _fail(
                    source,
                    f"subscription {keeper!r} exists on topic {held!r}, not {dead!r}: "
                    "delete it, or change the source's dead_letter_topic",
                )
            say(line)
        path = source.subscription or ""
        try:
            found = subscriber.get_subscription(subscription=path, retry=_RETRY, timeout=10)
        except api_exceptions.NotFound:
            found = None
        held = None if found is None else found.topic
        if held == _DELETED_TOPIC:
            raise _fail(
                source,
                f"subscription {path!r} exists, but its topic was deleted: nothing reaches it; "
                "delete the subscription and declare again",
            )
        if found is not None:
            say(f"subscription {path!r}: exists{_dead_letter_policy(found)}")
            return
        topic = path.replace("/subscriptions/", "/topics/", 1)
        say(_put_topic(publisher, topic))
        say(_put_subscription(subscriber, path, topic, f"ack deadline {ACK_DEADLINE_SECONDS} s"))


def _dead_letter_policy(subscription: Any) -> str:
    """What a dead-letter policy made elsewhere does, for the line (declare sets none)."""
    policy = subscription.dead_letter_policy
    if not policy.dead_letter_topic:
        return ""
    # Every delivery counts, the consumer's once per back-off while the
    # database is away: a low count moves messages never stored. 0 is 5.
    return (
        f"; its dead-letter policy moves a message delivered {policy.max_delivery_attempts or 5} "
        f"times to {policy.dead_letter_topic!r}, a database outage's deliveries too: "
        "raise max_delivery_attempts (100 at most)"
    )


@contextmanager
def _pubsub_clients(source: BrokerSourceConfig) -> Iterator[tuple[Any, Any]]:
    """A publisher and a subscriber client, closed after; a Google error as the command's."""
    try:
        # The clients look for credentials when made (no emulator, no
        # application default credentials: DefaultCredentialsError).
        publisher = pubsub_v1.PublisherClient()
        subscriber = pubsub_v1.SubscriberClient()
    except google.auth.exceptions.GoogleAuthError as exc:
        raise _fail(source, f"Pub/Sub: no credentials: {_describe(exc)}") from exc
    try:
        yield publisher, subscriber
    except google.auth.exceptions.GoogleAuthError as exc:
        raise _fail(source, f"Pub/Sub: credentials refused: {_describe(exc)}") from exc
    except _GOOGLE_ERRORS as exc:
        raise _fail(source, f"Pub/Sub: {_describe(exc)}") from exc
    finally:
        publisher.stop()
        subscriber.close()


def _put_topic(publisher: Any, topic: str) -> str:
    return _created_or_exists(
        f"topic {topic!r}", lambda: publisher.create_topic(name=topic, retry=_RETRY, timeout=10)
    )


def _put_subscription(subscriber: Any, path: str, topic: str, what: str) -> str:
    request = {"name": path, "topic": topic, "ack_deadline_seconds": ACK_DEADLINE_SECONDS}
    return _created_or_exists(
        f"subscription {path!r} (of {topic!r}, {what})",
        lambda: subscriber.create_subscription(request=request, retry=_RETRY, timeout=10),
    )


def _created_or_exists(shown: str, create: Callable[[], object]) -> str:
    """Create what ``shown`` names; its line: created, or exists when it already did."""
    try:
        create()
        return f"{shown}: created"
    except api_exceptions.AlreadyExists:
        return f"{shown}: exists"


def publish_pubsub(source: BrokerSourceConfig, body: bytes, placed: Placed) -> str:
    """Publish one message to the subscription's topic; the line to print (its message id)."""
    with _pubsub_clients(source) as (publisher, subscriber):
        try:
            topic = subscriber.get_subscription(
                subscription=source.subscription, retry=_RETRY, timeout=10
            ).topic
        except api_exceptions.NotFound as exc:
            raise _not_declared(source, f"subscription {source.subscription!r}") from exc
        message_id = publish_exactly(publisher, topic, body, placed.attributes, 30)
    return f"published to {topic!r} (message id {message_id}): {placed.shown(message_id)}"


# -- where the key and type travel ---------------------------------------------------


# What every ``flask brokers publish`` reads alike (these and manage's brokers).


def read_body(body: bytes, content_type: str | None) -> tuple[Any, bool, str | None]:
    """The body as JSON (None when it is not), whether it is, and its content type.

    The content type given, else application/json for a JSON body.
    """
    try:
        parsed: Any = loads(body)
    except JSONError:
        return None, False, content_type
    return parsed, True, content_type or "application/json"


def key_and_type_specs(
    source: BrokerSourceConfig, key: str | None, event_type: str | None
) -> Iterator[tuple[str, str, str | None, str, str, str]]:
    """The key spec, then the type spec: name, spec, value given, kind, argument, option."""
    for name, spec, value in (
        ("dedup_key", source.dedup_key, key),
        ("event_type", source.event_type, event_type),
    ):
        kind, arg = parse_broker_spec(spec, source.provider, name)
        yield name, spec, value, kind, arg, "--key" if name == "dedup_key" else "--type"


class Placed:
    """A message's attributes, and where its key and type travel, for the command's line."""

    def __init__(self) -> None:
        self.attributes: dict[str, str] = {}
        self.deduplication_id: str | None = None
        self.assigned_key = False
        self.parts: list[str] = []

    def shown(self, message_id: str) -> str:
        parts = list(self.parts)
        if self.assigned_key:
            parts.insert(0, f"dedup_key {message_id!r} (the broker's message id)")
        return ", ".join(parts) or "no key or type set"


def place(
    source: BrokerSourceConfig,
    body: bytes,
    key: str | None,
    event_type: str | None,
    content_type: str | None,
) -> Placed:
    """Where the source's specs read the key and type; UsageError for what cannot be placed."""
    placed = Placed()
    parsed, is_json, content_type = read_body(body, content_type)
    if content_type:
        placed.attributes["content-type"] = content_type
    for name, spec, value, kind, arg, option in key_and_type_specs(source, key, event_type):
        if kind == "json":
            found = pointers.resolve(parsed, arg) if is_json else None
            text = None if found is None or isinstance(found, dict | list) else str(found)
            if text is None and (name == "dedup_key" or value is not None):
                raise click.UsageError(
                    f"source {source.name} reads its {name} from the body ({spec}): "
                    "the body must carry it there as a JSON string or number"
                )
            if value is not None and value != text:
                raise click.UsageError(
                    f"{option}: the body holds {text!r} at {spec}, not {value!r}: "
                    "change the body, not the option"
                )
            if text is not None:
                placed.parts.append(f"{name} {text!r} at {spec}")
        elif kind == "property" and arg == "message_id":
            if value is not None:
                raise click.UsageError(
                    f"{option}: source {source.name}'s dedup key is the id the broker gives "
                    "each message; publish without --key (the id is printed)"
                )
            placed.assigned_key = True
        elif kind == "property" and arg == "deduplication_id":
            if value is None:
                raise click.UsageError(f"give {option}: the FIFO message's deduplication id")
            placed.deduplication_id = value
            placed.parts.append(f"MessageDeduplicationId {value!r}")
        elif kind == "header":
            if value is None:
                if name == "dedup_key":
                    raise click.UsageError(
                        f"give {option}: source {source.name} reads its dedup key from {spec}"
                    )
                continue
            placed.attributes[arg] = value
            placed.parts.append(f"attribute {arg} {value!r}")
    return placed
