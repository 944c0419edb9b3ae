"""Forwards to MQTT 5 (``mqtt://``, ``mqtts://``): QoS 1, done on the broker's PUBACK.

The message carries the event's body, its content type, and user
properties: ``message-id`` (the forward's stable key, what an ``mqtt``
source reads by default), ``type`` (the event type), ``X-Request-Id``
(the correlation id), ``X-Webhook-Source`` and ``X-Webhook-Event-Id``.
A PUBACK saying no subscription took it (reason 16) is a retryable
failure, as an unroutable AMQP publish is: a broker keeps a message only
for a session that has subscribed. One client per URL and process (paho's
network thread, which reconnects by itself, once a second while the
broker is away), shared by the worker's threads; a publish not
acknowledged within ``timeout_seconds`` fails and is retried with the
same ``message-id``. The timeout bounds the whole attempt: the wait for
the connection and the wait for its PUBACK share it.

A message the broker can never take goes dead at once rather than being
sent: a text (the event type, the correlation id, the content type) with
a character MQTT's UTF-8 strings refuse (a control character, a
non-character: Mosquitto drops the connection on one), or a PUBLISH
larger than the broker's Maximum Packet Size (its CONNACK says it).
paho keeps every unacknowledged message and sends it again on each
reconnect: a publish not acknowledged drops the client with its queue,
so that nothing it sent is sent again behind the delivery's back (nor,
if the broker cut the connection because of it, on every later
connection), and the next publish opens a fresh one.
"""

from __future__ import annotations

import re
import ssl
import threading
import time
from typing import Any
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from ...config import ForwardConfig, redact_url
from .base import BrokerMessage, PublishError, PublishRefused

SCHEMES = frozenset({"mqtt", "mqtts"})
# PUBACK's reason when no subscription took the message (MQTT 5, 3.4.2.1).
NO_MATCHING_SUBSCRIBERS = 16
# What an MQTT UTF-8 string may not hold (MQTT 5, 1.5.4): U+0000, the
# control characters and the non-characters, which Mosquitto takes for a
# malformed packet (and drops the connection); surrogates cannot be encoded.
_NONCHARACTERS = "".join(chr(plane << 16 | low) for plane in range(17) for low in (0xFFFE, 0xFFFF))
_NOT_MQTT_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\ufdd0-\ufdef" + _NONCHARACTERS + "]")
# An MQTT UTF-8 string holds at most this many bytes.
_MAX_STRING = 65535


def _check_text(what: str, value: str) -> None:
    """Refuse a text MQTT cannot carry: whatever the attempt, the broker would refuse it."""
    found = _NOT_MQTT_TEXT.search(value)
    if found:
        raise PublishRefused(
            f"the {what} holds {found.group()!r} (at {found.start()}), which an MQTT "
            f"UTF-8 string cannot carry: {value[:60]!r}"
        )
    if len(value.encode("utf-8")) > _MAX_STRING:
        raise PublishRefused(f"the {what} is longer than MQTT's {_MAX_STRING} bytes")


def _varint_size(value: int) -> int:
    size = 1
    while value >= 128:
        value //= 128
        size += 1
    return size


def _publish_size(topic: str, properties: Properties, payload: bytes) -> int:
    """The bytes of the QoS 1 PUBLISH paho sends for this (MQTT 5, 3.3)."""
    remaining = 2 + len(topic.encode("utf-8")) + 2 + len(properties.pack()) + len(payload)
    return 1 + _varint_size(remaining) + remaining


class _Publisher:
    """One connected client and the PUBACK reasons its network thread has seen, by packet id."""

    def __init__(self, forward: ForwardConfig) -> None:
        self.url = forward.url
        self.reasons: dict[int, Any] = {}
        self.connected = threading.Event()
        # The broker's Maximum Packet Size, from its CONNACK (None: MQTT's own).
        self.max_packet_size: int | None = None
        client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv5)
        url = urlsplit(forward.url)
        if url.username is not None:
            client.username_pw_set(
                unquote(url.username), None if url.password is None else unquote(url.password)
            )
        if url.scheme == "mqtts":
            client.tls_set_context(ssl.create_default_context())
        client.max_inflight_messages_set(1000)
        # paho doubles its wait between reconnects up to two minutes: the
        # forward's deliveries would fail for as long after the broker is
        # back. Back within a second of its return, as a Kafka forward is.
        client.reconnect_delay_set(min_delay=1, max_delay=1)
        client.on_connect = self._on_connect
        client.on_disconnect = lambda *_args: self.connected.clear()
        client.on_publish = self._on_publish
        client.connect_async(url.hostname or "127.0.0.1", url.port or _port(url.scheme))
        client.loop_start()
        self.client = client

    def _on_connect(self, _c: Any, _u: Any, _f: Any, reason: Any, properties: Any) -> None:
        if reason.is_failure:
            return
        self.max_packet_size = getattr(properties, "MaximumPacketSize", None)
        self.connected.set()

    def _on_publish(self, _c: Any, _u: Any, mid: int, reason: Any, _p: Any) -> None:
        self.reasons[mid] = reason

    def close(self) -> None:
        """Disconnect, and end the network thread: its unacknowledged messages go with it."""
        try:
            self.client.disconnect()
        except Exception:
            pass
        # Its network thread ends within a second (its select's timeout): not waited for here.
        threading.Thread(
            target=self.client.loop_stop, name="mqtt-forward-close", daemon=True
        ).start()

    def publish(self, topic: str, message: BrokerMessage, timeout: float) -> None:
        # One deadline for the connect and the PUBACK together: each had the
        # whole timeout, twice what the worker's lease is sized for.
        deadline = time.monotonic() + timeout
        properties = Properties(PacketTypes.PUBLISH)
        content_type = message.content_type or "application/octet-stream"
        properties.ContentType = content_type
        user = [("message-id", message.message_id), ("X-Request-Id", message.correlation_id)]
        if message.event_type:
            user.append(("type", message.event_type))
        user += message.headers.items()
        _check_text("topic", topic)
        _check_text("content type", content_type)
        for name, value in user:
            _check_text(f"{name!r} user property's name", name)
            _check_text("event type" if name == "type" else f"{name!r} user property", value)
        properties.UserProperty = user
        if not self.connected.wait(_left(deadline)):
            raise PublishError(f"not connected to {redact_url(self.url)} within {timeout} s")
        limit = self.max_packet_size
        size = _publish_size(topic, properties, message.body)
        if limit is not None and size > limit:
            raise PublishRefused(
                f"the message ({size} bytes, {len(message.body)} of body) is larger than "
                f"the Maximum Packet Size of {redact_url(self.url)} ({limit} bytes)"
            )
        info = self.client.publish(topic, message.body, qos=1, properties=properties)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            _drop(self)
            raise PublishError(f"publish to {redact_url(self.url)}: {mqtt.error_string(info.rc)}")
        try:
            info.wait_for_publish(_left(deadline))
        except (RuntimeError, ValueError) as exc:  # paho: the connection went away
            _drop(self)
            raise PublishError(f"{redact_url(self.url)}: {exc}") from exc
        if not info.is_published():
            self.reasons.pop(info.mid, None)
            _drop(self)
            raise PublishError(f"no PUBACK from {redact_url(self.url)} within {timeout} s")
        reason = self.reasons.pop(info.mid, None)
        if reason is not None and reason.value == NO_MATCHING_SUBSCRIBERS:
            raise PublishError(
                f"no session subscribes to {topic!r} on {redact_url(self.url)}: nothing kept it"
            )
        if reason is not None and reason.is_failure:
            raise PublishError(f"{redact_url(self.url)} refused the message: {reason}")


def _left(deadline: float) -> float:
    """The seconds left until ``deadline`` (``time.monotonic()``); none once it has passed."""
    return max(0.0, deadline - time.monotonic())


def _port(scheme: str) -> int:
    return 8883 if scheme == "mqtts" else 1883


_publishers: dict[str, _Publisher] = {}
_lock = threading.Lock()


def _drop(publisher: _Publisher) -> None:
    """Let a publisher whose publish was not acknowledged go: the next one opens a fresh client."""
    with _lock:
        if _publishers.get(publisher.url) is publisher:
            del _publishers[publisher.url]
    publisher.close()


def publish(forward: ForwardConfig, message: BrokerMessage) -> None:
    with _lock:
        publisher = _publishers.get(forward.url)
        if publisher is None:
            publisher = _publishers[forward.url] = _Publisher(forward)
    publisher.publish(forward.topic or "", message, forward.timeout_seconds)
