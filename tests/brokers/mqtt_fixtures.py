"""MQTT for the broker tests: the tests' own Mosquitto (tests/mosquitto.py), a session per test.

Each test gets topics under a prefix of its own, the consumer's client id,
its persistent session made before anything is published (MQTT keeps
messages only for a session that has subscribed), and a collector of the
dead-letter topic that acknowledges what it is sent.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from .. import mosquitto

# A user property name and value, as MQTT 5 carries them (a name may repeat).
UserProperties = list[tuple[str, str]]


@pytest.fixture(scope="session")
def mqtt_broker() -> mosquitto.Mosquitto:
    """The tests' Mosquitto, started once per session."""
    from .conftest import _unavailable

    try:
        return mosquitto.broker()
    except Exception as exc:
        _unavailable("Mosquitto", exc)
        raise


def client(client_id: str = "", **options: Any) -> Any:
    """A paho-mqtt MQTT 5 client (not connected)."""
    return mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=MQTTProtocolVersion.MQTTv5,
        **options,
    )


@dataclass
class MqttTopics:
    """A test's topics (``<prefix>/...``), the consumer's session and the dead letters it sent."""

    broker: mosquitto.Mosquitto
    prefix: str
    published: int = 0
    dead: list[tuple[bytes, UserProperties]] = field(default_factory=list)
    _collector: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return self.broker.url

    @property
    def client_id(self) -> str:
        return f"{self.prefix}-consumer"

    @property
    def topic_filter(self) -> str:
        return f"{self.prefix}/+/events"

    @property
    def dead_topic(self) -> str:
        return f"{self.prefix}-dead/events"

    def open_session(self, client_id: str | None = None, topic_filter: str | None = None) -> None:
        """Make the consumer's persistent session (subscribed with QoS 1) before any publish."""
        c = client(client_id or self.client_id)
        connect = Properties(PacketTypes.CONNECT)
        connect.SessionExpiryInterval = 3600
        c.connect("127.0.0.1", self.broker.port, clean_start=False, properties=connect)
        subscribed = threading.Event()
        c.on_subscribe = lambda *_args: subscribed.set()
        c.loop_start()
        try:
            c.subscribe(topic_filter or self.topic_filter, qos=1)
            assert subscribed.wait(10), "no SUBACK"
        finally:
            c.disconnect()
            c.loop_stop()

    def start_collector(self) -> None:
        """Collect (and acknowledge) whatever reaches the dead-letter topic."""
        c = client(f"{self.prefix}-dead-reader")
        subscribed = threading.Event()

        def on_message(_c: Any, _u: Any, message: Any) -> None:
            props = list(getattr(message.properties, "UserProperty", []) or [])
            with self._lock:
                self.dead.append((message.payload, props))

        c.on_message = on_message
        c.on_subscribe = lambda *_args: subscribed.set()
        c.connect("127.0.0.1", self.broker.port)
        c.loop_start()
        c.subscribe(self.dead_topic, qos=1)
        assert subscribed.wait(10), "no SUBACK"
        self._collector = c

    def close(self) -> None:
        if self._collector is not None:
            self._collector.disconnect()
            self._collector.loop_stop()
            self._collector = None

    def publish(self, messages: list[tuple[str, bytes, UserProperties]], qos: int = 1) -> None:
        """Publish (topic level, payload, user properties) to ``<prefix>/<level>/events``."""
        c = client(f"{self.prefix}-publisher-{uuid.uuid4().hex[:6]}")
        c.max_inflight_messages_set(1000)
        c.connect("127.0.0.1", self.broker.port)
        c.loop_start()
        try:
            infos = []
            for level, payload, user_properties in messages:
                props = Properties(PacketTypes.PUBLISH)
                props.ContentType = "application/json"
                if user_properties:
                    props.UserProperty = user_properties
                infos.append(
                    c.publish(f"{self.prefix}/{level}/events", payload, qos=qos, properties=props)
                )
            for info in infos:
                info.wait_for_publish(30)
                assert info.is_published()
        finally:
            c.disconnect()
            c.loop_stop()
        self.published += len(messages)

    def sent(self, *, redelivered: bool = False) -> int:
        """PUBLISH packets the broker sent the consumer (DUP set: ``redelivered``)."""
        return self.broker.count(mosquitto.SENT, self.client_id, redelivered=redelivered)

    def acked(self) -> int:
        """PUBACKs the broker received from the consumer."""
        return self.broker.count(mosquitto.ACKED, self.client_id)

    def dead_letters(self) -> list[tuple[bytes, dict[str, str]]]:
        """Every dead letter the consumer published: (payload, user properties), once collected."""
        deadline = time.monotonic() + 10
        expected = self.broker.count(mosquitto.PUBLISHED, self.client_id)
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.dead) >= expected:
                    break
            time.sleep(0.05)
        with self._lock:
            return [(payload, dict(props)) for payload, props in self.dead]


@pytest.fixture
def mqtt_topics(mqtt_broker: mosquitto.Mosquitto) -> Iterator[MqttTopics]:
    """Fresh topics, the consumer's session made and the dead-letter collector running."""
    topics = MqttTopics(mqtt_broker, f"wr-test-{uuid.uuid4().hex[:10]}")
    topics.start_collector()
    topics.open_session()
    yield topics
    topics.close()


def mqtt_source(topics: MqttTopics, **extra: Any) -> dict[str, Any]:
    """A broker source table consuming ``topics`` in the session made for it."""
    return {
        "provider": "mqtt",
        "url": topics.url,
        "topics": [topics.topic_filter],
        "client_id": topics.client_id,
        "dedup_key": "user_property:message-id",
        "event_type": "user_property:type",
        "dead_letter_topic": topics.dead_topic,
        **extra,
    }
