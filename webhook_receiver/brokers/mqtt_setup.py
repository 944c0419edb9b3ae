"""``flask brokers declare`` and ``publish`` for an MQTT source.

An MQTT broker keeps a message only for a session that has subscribed to
its topic: ``declare`` makes the source's persistent session (its
``client_id``, clean start off, the consumer's session expiry) and
subscribes it to ``topics`` with QoS 1, so that what is published from
then on waits for the consumer; and a session of the ``dead_letter_topic``'s
name subscribed to it, which keeps the dead letters. ``publish`` sends one
message with QoS 1, the key and type in user properties (or the type as
the topic), and waits for the broker's PUBACK.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import click
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from ..config import BrokerSourceConfig
from ..config.brokers import mqtt_topic_matches
from .mqtt import ANSWER_SECONDS, SESSION_EXPIRY_SECONDS

# PUBACK's reason when no subscription took the message (MQTT 5, 3.4.2.1).
_NO_SUBSCRIBERS = 16


def _fail(source: BrokerSourceConfig, problem: str) -> click.ClickException:
    return click.ClickException(f"source {source.name}: {problem}")


class _Connection:
    """A connected paho-mqtt client and what the broker answered, served on this thread."""

    def __init__(self, source: BrokerSourceConfig, client_id: str, *, session: bool) -> None:
        self.source = source
        self.answers: dict[str, Any] = {}
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=MQTTProtocolVersion.MQTTv5,
            reconnect_on_failure=False,
            # Never acknowledged here: a session resumed (``declare`` run
            # again) is sent the messages waiting in it, which are the
            # consumer's; unacknowledged, they go to it on its next connection.
            manual_ack=True,
        )
        url = urlsplit(source.url)
        if url.username is not None:
            self.client.username_pw_set(
                unquote(url.username), None if url.password is None else unquote(url.password)
            )
        if url.scheme == "mqtts":
            self.client.tls_set()
        self.client.on_connect = lambda _c, _u, flags, reason, _p: self.answers.update(
            connack=(flags, reason)
        )
        self.client.on_subscribe = lambda _c, _u, _m, reasons, _p: self.answers.update(
            suback=reasons
        )
        self.client.on_publish = lambda _c, _u, _m, reason, _p: self.answers.update(puback=reason)
        properties = Properties(PacketTypes.CONNECT)
        if session:
            properties.SessionExpiryInterval = SESSION_EXPIRY_SECONDS
        try:
            self.client.connect(
                url.hostname or "127.0.0.1",
                url.port or (8883 if url.scheme == "mqtts" else 1883),
                clean_start=not session,
                properties=properties,
            )
            flags, reason = self.wait("connack")
        except OSError as exc:
            raise _fail(source, f"cannot reach MQTT at {source.safe_url}: {exc}") from exc
        if reason.is_failure:
            raise _fail(source, f"MQTT at {source.safe_url} refused the connection: {reason}")
        self.session_present = bool(flags.session_present)

    def wait(self, answer: str) -> Any:
        deadline = time.monotonic() + ANSWER_SECONDS
        while answer not in self.answers:
            rc = self.client.loop(0.1)
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or time.monotonic() > deadline:
                raise _fail(
                    self.source, f"MQTT at {self.source.safe_url}: no {answer.upper()} ({rc})"
                )
        return self.answers.pop(answer)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop(0.1)


def declare_mqtt(source: BrokerSourceConfig, say: Callable[[str], None]) -> None:
    """Make the source's persistent session, subscribed to its topics with QoS 1."""
    client_id = source.client_id or ""
    state = _subscribed_session(source, client_id, source.topics)
    say(f"session {client_id!r} ({', '.join(source.topics)}, QoS 1): {state}")


def declare_mqtt_dead_letters(source: BrokerSourceConfig, say: Callable[[str], None]) -> None:
    """Make a persistent session of the dead-letter topic's name, subscribed to it.

    The broker keeps a dead letter only for a session subscribed to its
    topic; without one, its PUBACK says no subscription took it, and the
    consumer gets the original again on every connection.
    """
    dead = source.dead_letter_topic
    if dead:
        state = _subscribed_session(source, dead, [dead])
        say(f"session {dead!r} ({dead}, QoS 1, keeps the dead letters): {state}")


def _subscribed_session(source: BrokerSourceConfig, client_id: str, topics: Sequence[str]) -> str:
    """Subscribe the persistent session ``client_id`` to ``topics``: created, or exists."""
    connection = _Connection(source, client_id, session=True)
    try:
        # Retain handling 1, as the consumer subscribes: a topic's retained
        # message goes to the session when its subscription is new, not
        # again (a second copy) each time declare is run.
        options = SubscribeOptions(qos=1, retainHandling=SubscribeOptions.RETAIN_SEND_IF_NEW_SUB)
        connection.client.subscribe([(topic, options) for topic in topics])
        refused = [
            f"{topic} ({code})"
            for topic, code in zip(topics, connection.wait("suback"), strict=False)
            if code.is_failure
        ]
        if refused:
            raise _fail(source, f"the broker refused the subscription to {', '.join(refused)}")
        return "exists" if connection.session_present else "created"
    finally:
        connection.close()


def publish_mqtt(
    source: BrokerSourceConfig,
    body: bytes,
    user_properties: dict[str, str],
    content_type: str | None,
    topic: str | None,
    shown: str,
) -> str:
    """Publish with QoS 1 on ``topic`` (or the source's one topic without wildcards)."""
    if topic is None:
        literal = [t for t in source.topics if "+" not in t and "#" not in t]
        if len(source.topics) != 1 or not literal:
            raise click.UsageError(
                f"give --subject: a topic that {', '.join(source.topics)} takes, to publish on"
            )
        topic = literal[0]
    if not topic or "+" in topic or "#" in topic:
        raise click.UsageError(f"{topic!r} is not a topic to publish on (no wildcards)")
    if not any(mqtt_topic_matches(taken, topic) for taken in source.topics):
        raise click.UsageError(
            f"topic {topic!r} is outside {', '.join(source.topics)}, "
            f"what source {source.name} consumes: it would never see the message"
        )
    properties = Properties(PacketTypes.PUBLISH)
    if content_type:
        properties.ContentType = content_type
    if user_properties:
        properties.UserProperty = list(user_properties.items())
    connection = _Connection(source, "", session=False)
    try:
        connection.client.publish(topic, body, qos=1, properties=properties)
        reason = connection.wait("puback")
    finally:
        connection.close()
    if reason.value == _NO_SUBSCRIBERS:
        raise _fail(
            source,
            f"no session subscribes to {topic!r}, so the broker kept nothing: "
            f"run `flask --app wsgi brokers declare {source.name}` first",
        )
    if reason.is_failure:
        raise _fail(source, f"the broker refused the message: {reason}")
    return f"published to {topic} (QoS 1, acknowledged): {shown}"
