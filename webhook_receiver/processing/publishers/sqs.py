"""Forwards to Amazon SQS (``sqs://<host>/<account>/<queue>``): done on SendMessage's answer.

The message's body is the event's (SQS carries text: a body that is not
UTF-8, or holds characters SQS refuses, cannot be sent and the delivery
goes dead at once); its attributes: ``message-id`` (the forward's stable
key, what an ``sqs`` source reads with ``dedup_key =
"attribute:message-id"``), ``type`` (the event type), ``content-type``,
``X-Request-Id`` (the correlation id) and the forward's headers
(``X-Webhook-Source``, ``X-Webhook-Event-Id``). On a FIFO queue the stable
key is also the ``MessageDeduplicationId`` (its SHA-256 when longer than
SQS's 128 characters or outside its alphabet), so a worker killed between
the send and marking the delivery done sends again within SQS's five
minutes without a second message; the group is the event's source (its
SHA-256 too when SQS would refuse it as a ``MessageGroupId``: a source
name past 128 characters, or with a space or a character outside ASCII).
Credentials come from the standard AWS chain; one client per region and
endpoint, shared by the worker's threads.

An attempt lasts ``timeout_seconds`` in all: botocore's timeouts bound the
connect and each read of the socket (an answer trickled out holds it for
ever), so the attempt's sockets are shut down when its time is up
(:mod:`..deadline`), and the endpoint's name is resolved within that
time too (getaddrinfo has no timeout); botocore sends once, the worker
retries.
"""

from __future__ import annotations

import hashlib
import re
import threading
from typing import Any

import boto3
import botocore.awsrequest
import botocore.config
import botocore.exceptions

from ...config import ForwardConfig
from .. import deadline
from .base import BrokerMessage, PublishError, PublishRefused

SCHEMES = frozenset({"sqs"})
# What SQS says of a message it will never take, whatever the attempt.
_REFUSED = frozenset(
    {
        "InvalidMessageContents",
        "MessageTooLong",
        "InvalidParameterValue",
        "InvalidAttributeName",
        "InvalidAttributeValue",
    }
)
# A MessageDeduplicationId or MessageGroupId: up to 128 of these.
_DEDUPLICATION_ID = re.compile(r"^[!-~]{1,128}$")
MAX_ATTRIBUTES = 10

_clients: dict[tuple[str | None, str | None, float], Any] = {}
_lock = threading.Lock()


def queue_url(forward: ForwardConfig) -> str:
    """The QueueUrl a forward sends to: its URL over HTTPS, or on its endpoint_url."""
    host, _, path = forward.url.removeprefix("sqs://").partition("/")
    base = (forward.endpoint_url or f"https://{host}").rstrip("/")
    return f"{base}/{path}"


class _WatchedHTTPConnection(deadline.WatchedConnection, botocore.awsrequest.AWSHTTPConnection):
    pass


class _WatchedHTTPSConnection(deadline.WatchedConnection, botocore.awsrequest.AWSHTTPSConnection):
    pass


class _HTTPPool(botocore.awsrequest.AWSHTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _HTTPSPool(botocore.awsrequest.AWSHTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


def _watch(client: Any) -> None:
    """Make ``client``'s connections register with the running attempt's deadline.

    botocore's HTTP session (private) gives its pool manager, and each proxy
    manager it makes later, these pool classes.
    """
    http = client._endpoint.http_session
    http._pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
    http._manager.pool_classes_by_scheme = http._pool_classes_by_scheme


def _client(forward: ForwardConfig) -> Any:
    key = (forward.region, forward.endpoint_url, forward.timeout_seconds)
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = boto3.session.Session().client(
                "sqs",
                region_name=forward.region,
                endpoint_url=forward.endpoint_url,
                config=botocore.config.Config(
                    connect_timeout=forward.timeout_seconds,
                    read_timeout=forward.timeout_seconds,
                    # One attempt: botocore's max_attempts counts retries, so
                    # 1 sent a send whose answer was lost twice, within one
                    # delivery attempt (and took twice the timeout); the
                    # worker retries, with its backoff.
                    retries={"total_max_attempts": 1, "mode": "standard"},
                ),
            )
            _watch(client)
        return client


def _sqs_id(value: str) -> str:
    """``value`` as a MessageDeduplicationId or MessageGroupId: itself, or its SHA-256 (as stable).

    Both take 1 to 128 characters of ASCII letters, digits and punctuation;
    SQS refuses anything else (InvalidParameterValue), whatever the attempt.
    """
    if _DEDUPLICATION_ID.match(value):
        return value
    return hashlib.sha256(value.encode("utf-8")).hexdigest()


def publish(forward: ForwardConfig, message: BrokerMessage) -> None:
    values = message.attributes()
    if len(values) > MAX_ATTRIBUTES:
        raise PublishRefused(f"{len(values)} attributes: SQS takes {MAX_ATTRIBUTES} at most")
    try:
        body = message.body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PublishRefused("the body is not UTF-8 text, which SQS carries only") from exc
    request: dict[str, Any] = {
        "QueueUrl": queue_url(forward),
        "MessageBody": body,
        "MessageAttributes": {
            name: {"DataType": "String", "StringValue": value} for name, value in values.items()
        },
    }
    if forward.url.endswith(".fifo"):
        request["MessageDeduplicationId"] = _sqs_id(message.message_id)
        request["MessageGroupId"] = _sqs_id(
            message.headers.get("X-Webhook-Source") or "webhook-receiver"
        )
    client = _client(forward)
    with deadline.bounded(forward.timeout_seconds) as attempt:
        try:
            client.send_message(**request)
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            error = PublishRefused if code in _REFUSED else PublishError
            raise error(f"SQS refused the message ({code}): {exc}") from exc
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            if attempt.unresolved is not None:
                raise PublishError(
                    f"{attempt.unresolved} did not resolve within {forward.timeout_seconds:g} s:"
                    " no SendMessage sent"
                ) from exc
            if attempt.expired or not attempt.left():
                raise PublishError(
                    f"no SendMessage answer within {forward.timeout_seconds:g} s"
                    f" (its connect included): {type(exc).__name__}: {exc}"
                ) from exc
            raise PublishError(f"{type(exc).__name__}: {exc}") from exc
