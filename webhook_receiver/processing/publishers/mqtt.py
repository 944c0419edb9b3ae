"""Forwards to MQTT 5 (``mqtt://``, ``mqtts://``): QoS 1, done on the broker's PUBACK.

The message carries the event's body, its content type, and user
properties: ``message-id`` (the forward's stable key, what an ``mqtt``
source reads by default), ``type`` (the event type), ``X-Request-Id``
(the correlation id), ``X-Webhook-Source`` and ``X-Webhook-Event-Id``.
A PUBACK saying no subscription took it (reason 16) is a retryable
failure, as an unroutable AMQP publish is: a broker keeps a message only
for a session that has subscribed. One client per URL and process (paho's
network thread, which reconnects by itself), shared by the worker's
threads; a publish not acknowledged within ``timeout_seconds`` fails and
is retried with the same ``message-id``.
"""

from __future__ import annotations

import ssl
import threading
from typing import Any
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from ...config import ForwardConfig, redact_url
from .base import BrokerMessage, PublishError

SCHEMES = frozenset({"mqtt", "mqtts"})
# PUBACK's reason when no subscription took the message (MQTT 5, 3.4.2.1).
NO_MATCHING_SUBSCRIBERS = 16


class _Publisher:
    """One connected client and the PUBACK reasons its network thread has seen, by packet id."""

    def __init__(self, forward: ForwardConfig) -> None:
        self.url = forward.url
        self.reasons: dict[int, Any] = {}
        self.connected = threading.Event()
        client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv5)
        url = urlsplit(forward.url)
        if url.username is not None:
            client.username_pw_set(
                unquote(url.username), None if url.password is None else unquote(url.password)
            )
        if url.scheme == "mqtts":
            client.tls_set_context(ssl.create_default_context())
        client.max_inflight_messages_set(1000)
        client.on_connect = lambda _c, _u, _f, reason, _p: (
            None if reason.is_failure else self.connected.set()
        )
        client.on_disconnect = lambda *_args: self.connected.clear()
        client.on_publish = self._on_publish
        client.connect_async(url.hostname or "127.0.0.1", url.port or _port(url.scheme))
        client.loop_start()
        self.client = client

    def _on_publish(self, _c: Any, _u: Any, mid: int, reason: Any, _p: Any) -> None:
        self.reasons[mid] = reason

    def publish(self, topic: str, message: BrokerMessage, timeout: float) -> None:
        if not self.connected.wait(timeout):
            raise PublishError(f"not connected to {redact_url(self.url)} within {timeout} s")
        properties = Properties(PacketTypes.PUBLISH)
        properties.ContentType = message.content_type or "application/octet-stream"
        user = [("message-id", message.message_id), ("X-Request-Id", message.correlation_id)]
        if message.event_type:
            user.append(("type", message.event_type))
        properties.UserProperty = [*user, *message.headers.items()]
        info = self.client.publish(topic, message.body, qos=1, properties=properties)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise PublishError(f"publish to {redact_url(self.url)}: {mqtt.error_string(info.rc)}")
        try:
            info.wait_for_publish(timeout)
        except (RuntimeError, ValueError) as exc:  # paho: the connection went away
            raise PublishError(f"{redact_url(self.url)}: {exc}") from exc
        if not info.is_published():
            self.reasons.pop(info.mid, None)
            raise PublishError(f"no PUBACK from {redact_url(self.url)} within {timeout} s")
        reason = self.reasons.pop(info.mid, None)
        if reason is not None and reason.value == NO_MATCHING_SUBSCRIBERS:
            raise PublishError(
                f"no session subscribes to {topic!r} on {redact_url(self.url)}: nothing kept it"
            )
        if reason is not None and reason.is_failure:
            raise PublishError(f"{redact_url(self.url)} refused the message: {reason}")


def _port(scheme: str) -> int:
    return 8883 if scheme == "mqtts" else 1883


_publishers: dict[str, _Publisher] = {}
_lock = threading.Lock()


def publish(forward: ForwardConfig, message: BrokerMessage) -> None:
    with _lock:
        publisher = _publishers.get(forward.url)
        if publisher is None:
            publisher = _publishers[forward.url] = _Publisher(forward)
    publisher.publish(forward.topic or "", message, forward.timeout_seconds)
