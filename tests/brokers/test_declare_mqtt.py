"""``flask brokers declare`` for MQTT: the sessions it makes, as the consumer then needs them."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from .. import mosquitto
from .mqtt_fixtures import client

SOURCE = "devices"


class Names:
    """A test's topics and client id; the sessions declare made ended after."""

    def __init__(self, broker: mosquitto.Mosquitto) -> None:
        self.broker = broker
        self.prefix = f"wr-declare-{uuid.uuid4().hex[:10]}"
        self.client_id = f"{self.prefix}-consumer"
        self.topic_filter = f"{self.prefix}/+/events"
        self.dead_topic = f"{self.prefix}-dead/events"

    def source(self, **extra: Any) -> dict[str, Any]:
        return {
            "provider": "mqtt",
            "url": self.broker.url,
            "topics": [self.topic_filter],
            "client_id": self.client_id,
            **extra,
        }

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> int:
        """Publish with QoS 1; the PUBACK's reason code."""
        c = client()
        acked = threading.Event()
        reasons: list[int] = []

        def on_publish(_c: Any, _u: Any, _mid: int, reason: Any, _p: Any) -> None:
            reasons.append(reason.value)
            acked.set()

        c.on_publish = on_publish
        c.connect("127.0.0.1", self.broker.port)
        c.loop_start()
        try:
            c.publish(topic, payload, qos=1, retain=retain)
            assert acked.wait(10), "no PUBACK"
        finally:
            c.disconnect()
            c.loop_stop()
        return reasons[0]

    def waiting(self, client_id: str, seconds: float = 1.5) -> list[bytes]:
        """The payloads the session ``client_id`` holds, sent on its resumption (acknowledged)."""
        c = client(client_id)
        got: list[bytes] = []
        present = threading.Event()
        c.on_message = lambda _c, _u, message: got.append(message.payload)
        c.on_connect = lambda _c, _u, flags, _r, _p: flags.session_present and present.set()
        connect = Properties(PacketTypes.CONNECT)
        connect.SessionExpiryInterval = 3600
        c.connect("127.0.0.1", self.broker.port, clean_start=False, properties=connect)
        c.loop_start()
        try:
            assert present.wait(5), f"no session {client_id!r}"
            threading.Event().wait(seconds)
        finally:
            c.disconnect()
            c.loop_stop()
        return got

    def end_session(self, client_id: str) -> None:
        c = client(client_id)
        c.connect("127.0.0.1", self.broker.port, clean_start=True)
        c.loop_start()
        c.disconnect()
        c.loop_stop()


@pytest.fixture
def names(mqtt_broker: mosquitto.Mosquitto) -> Iterator[Names]:
    names = Names(mqtt_broker)
    yield names
    for client_id in (names.client_id, names.dead_topic):
        names.end_session(client_id)


def _declare(app: Any) -> list[str]:
    result = app.test_cli_runner().invoke(args=["brokers", "declare"])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def test_declare_makes_a_session_that_keeps_the_dead_letters(make_app, names):
    # The consumer's dead letter that no session subscribes to is kept by no
    # one (PUBACK 16): the original comes back on every connection, for ever.
    app = make_app({"sources": {SOURCE: names.source(dead_letter_topic=names.dead_topic)}})
    lines = _declare(app)
    assert lines == [
        f"{SOURCE}: session {names.client_id!r} ({names.topic_filter}, QoS 1): created",
        f"{SOURCE}: session {names.dead_topic!r} ({names.dead_topic}, QoS 1, "
        "keeps the dead letters): created",
    ]
    assert _declare(app)[1].endswith(": exists")
    assert names.publish(names.dead_topic, b"dead") == 0  # taken, not 16
    assert names.waiting(names.dead_topic) == [b"dead"]


def test_declare_run_again_sends_the_session_no_retained_message_again(make_app, names):
    # The consumer subscribes with retain handling 1: a retained message goes
    # to the session once, when its subscription is new. Declare must not
    # queue it again, each time it is run, as a second copy.
    names.publish(f"{names.prefix}/sensor-1/events", b"retained", retain=True)
    try:
        app = make_app({"sources": {SOURCE: names.source()}})
        _declare(app)
        _declare(app)
        sent = names.broker.count(mosquitto.SENT, names.client_id)
        again = names.broker.count(mosquitto.SENT, names.client_id, redelivered=True)
        assert sent - again == 1
        assert names.waiting(names.client_id) == [b"retained"]
    finally:
        names.publish(f"{names.prefix}/sensor-1/events", b"", retain=True)  # cleared
