"""Forwards to brokers through the real worker and a real broker: what a broker refuses.

A message a broker can never take must end in a clear failure, and never
hold back the deliveries after it on the same connection.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from webhook_receiver.config.forwards import parse_forwards
from webhook_receiver.processing import forwarding

from .. import mosquitto
from ..brokers.cloud_fixtures import (  # noqa: F401  (fixtures)
    PROJECT,
    SqsQueue,
    pubsub_host,
    pubsub_subscription,
    sqs_endpoint,
    sqs_queue,
)
from ..brokers.mqtt_fixtures import client as mqtt_client
from ..servers import Relay
from ..session_server import end, free_port
from .conftest import FAST, config_with, delivery, drain, forward, outgoing, store_event


def _wait_for(predicate: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


class _Reader:
    """A session subscribed to a topic (so that the broker keeps what is published to it)."""

    def __init__(self, port: int, topic: str) -> None:
        self.got: list[tuple[bytes, dict[str, str]]] = []
        subscribed = threading.Event()
        self.client = mqtt_client(f"reader-{uuid.uuid4().hex[:8]}")
        self.client.on_message = lambda _c, _u, m: self.got.append(
            (m.payload, dict(getattr(m.properties, "UserProperty", []) or []))
        )
        self.client.on_subscribe = lambda *_args: (subscribed.set(), self.subscriptions.append(1))
        self.subscriptions: list[int] = []
        self.client.on_connect = lambda c, *_args: c.subscribe(topic, qos=1)
        self.client.reconnect_delay_set(min_delay=1, max_delay=1)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert subscribed.wait(10), "the reader did not subscribe"

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def mqtt_reader() -> Iterator[tuple[str, str, _Reader]]:
    """The tests' Mosquitto's URL, a topic of this test's own and a session reading it."""
    try:
        broker = mosquitto.broker()
    except Exception as exc:  # no Mosquitto on this machine
        pytest.skip(f"Mosquitto: {exc}")
    topic = f"fwd-{uuid.uuid4().hex[:8]}/events"
    reader = _Reader(broker.port, topic)
    try:
        yield broker.url, topic, reader
    finally:
        reader.close()


class _PrivateMosquitto:
    """A Mosquitto of a test's own on a fixed port, to stop and start again (``extra``: config)."""

    def __init__(self, extra: str = "") -> None:
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="mosquitto-fwd-"))
        self.folder.chmod(0o1777)
        (self.folder / "mosquitto.conf").write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n{extra}"
        )
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [mosquitto.MOSQUITTO, "-c", str(self.folder / "mosquitto.conf")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert _wait_for(lambda: _listening(self.port), 15), "mosquitto did not listen"

    def stop(self) -> None:
        if self.process is not None:
            end(self.process)
            self.process = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def private_mosquitto() -> Iterator[Any]:
    """Make Mosquittos of the test's own (started), removed afterwards."""
    if not Path(mosquitto.MOSQUITTO).exists():
        pytest.skip("no Mosquitto on this machine")
    made: list[_PrivateMosquitto] = []

    def make(extra: str = "") -> _PrivateMosquitto:
        server = _PrivateMosquitto(extra)
        made.append(server)
        server.start()
        return server

    yield make
    for server in made:
        server.remove()


@pytest.fixture
def small_packet_mqtt(private_mosquitto: Any) -> Iterator[tuple[str, str, _Reader]]:
    """A Mosquitto of this test's own, taking packets of 4 KB at most; a topic and its reader."""
    server = private_mosquitto("max_packet_size 4096\n")
    topic = f"fwd-{uuid.uuid4().hex[:8]}/events"
    reader = _Reader(server.port, topic)
    try:
        yield server.url, topic, reader
    finally:
        reader.close()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


# -- MQTT ----------------------------------------------------------------------


def test_mqtt_forward_of_an_event_type_with_a_control_character_goes_dead_and_the_next_is_sent(
    make_app, clock, make_worker, mqtt_reader
):
    # Mosquitto takes a user property holding a control character for a
    # malformed packet and drops the connection; paho sent the message
    # again on every reconnect, so every later delivery of the forward
    # failed too, for ever.
    url, topic, reader = mqtt_reader
    app = make_app(config_with([forward("bus", url, topic=topic, timeout_seconds=2)]), **FAST)
    bad = store_event(app, clock, dedup_key="evt-1", event_type="order\x01paid")
    good = store_event(app, clock, dedup_key="evt-2", event_type="order.paid")
    assert drain(app, make_worker(app, clock)) == ["dead", "delivered"]
    row = delivery(app, bad, "bus")
    assert row["state"] == "dead"
    assert "event type" in row["last_error"] and "MQTT" in row["last_error"]
    assert delivery(app, good, "bus")["state"] == "delivered"
    assert _wait_for(lambda: len(reader.got) == 1)
    [(body, props)] = reader.got
    assert props["message-id"] == "bus:shop:evt-2"
    assert props["type"] == "order.paid"


def test_mqtt_forward_larger_than_the_brokers_maximum_packet_size_goes_dead_and_the_next_is_sent(
    make_app, clock, make_worker, small_packet_mqtt
):
    # Mosquitto drops a client that sends a packet past its max_packet_size
    # (its CONNACK says the limit); paho sent it again on every reconnect.
    url, topic, reader = small_packet_mqtt
    app = make_app(config_with([forward("bus", url, topic=topic, timeout_seconds=2)]), **FAST)
    big = store_event(app, clock, dedup_key="evt-1", data={"pad": "x" * 5000})
    small = store_event(app, clock, dedup_key="evt-2")
    assert drain(app, make_worker(app, clock)) == ["dead", "delivered"]
    row = delivery(app, big, "bus")
    assert row["state"] == "dead"
    assert "Maximum Packet Size" in row["last_error"] and "4096" in row["last_error"]
    assert delivery(app, small, "bus")["state"] == "delivered"
    assert _wait_for(lambda: len(reader.got) == 1)
    assert reader.got[0][1]["message-id"] == "bus:shop:evt-2"


def test_mqtt_forward_delivers_again_soon_after_its_broker_restarts(
    make_app, clock, make_worker, private_mosquitto
):
    # paho backs off between reconnects, doubling up to two minutes: a
    # broker away for 8 s was tried again only at 15 s, and every delivery
    # failed ("not connected") for 7 s after it was back (a minute after
    # an outage of a minute).
    server = private_mosquitto()
    topic = f"fwd-{uuid.uuid4().hex[:8]}/events"
    reader = _Reader(server.port, topic)
    try:
        bus = forward("bus", server.url, topic=topic, timeout_seconds=1, max_attempts=100)
        app = make_app(config_with([bus]), **FAST)
        worker = make_worker(app, clock)
        store_event(app, clock, dedup_key="evt-1")
        assert drain(app, worker) == ["delivered"]
        server.stop()
        down = time.monotonic()
        late = store_event(app, clock, dedup_key="evt-2")
        outcomes = []
        while time.monotonic() - down < 8:  # each attempt fails within its 1 s timeout
            clock.advance(3600)
            outcomes += drain(app, worker)
        assert set(outcomes) == {"retry"}
        seen = len(reader.subscriptions)
        server.start()
        assert _wait_for(lambda: len(reader.subscriptions) > seen, 10)
        back = time.monotonic()
        while delivery(app, late, "bus")["state"] != "delivered" and time.monotonic() - back < 3:
            clock.advance(3600)
            drain(app, worker)
        assert delivery(app, late, "bus")["state"] == "delivered"
        assert _wait_for(lambda: len(reader.got) == 2)
    finally:
        reader.close()


# -- Pub/Sub -------------------------------------------------------------------


def test_pubsub_forward_of_a_message_past_pubsubs_10_mb_goes_dead_at_once(
    make_app,
    clock,
    make_worker,
    pubsub_subscription,  # noqa: F811
):
    # The client refuses it before sending (MessageTooLargeError): no attempt
    # can get past that, and the docs say such a message goes dead at once.
    topic = pubsub_subscription.name
    url = f"pubsub://{PROJECT}/{topic}"
    app = make_app(config_with([forward("topic", url, timeout_seconds=2)]), **FAST)
    big = store_event(app, clock, dedup_key="evt-1", body=b"x" * (10 * 1024 * 1024 + 1))
    small = store_event(app, clock, dedup_key="evt-2")
    assert drain(app, make_worker(app, clock)) == ["dead", "delivered"]
    row = delivery(app, big, "topic")
    assert (row["state"], row["attempts"]) == ("dead", 1)
    assert "too large for Pub/Sub" in row["last_error"]
    assert delivery(app, small, "topic")["state"] == "delivered"


def test_pubsub_forward_of_a_key_past_an_attributes_1024_bytes_sends_its_stable_digest(
    make_app,
    clock,
    make_worker,
    pubsub_subscription,  # noqa: F811
):
    # Pub/Sub refuses an attribute value past 1,024 bytes (the emulator does
    # not check): a 400-character key outside ASCII is percent-encoded into
    # 2,400, so the message-id must travel as a digest of itself.
    from google.cloud import pubsub_v1

    url = f"pubsub://{PROJECT}/{pubsub_subscription.name}"
    app = make_app(config_with([forward("topic", url, timeout_seconds=2)]), **FAST)
    key = "é" * 400
    store_event(app, clock, dedup_key=key)
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    subscriber = pubsub_v1.SubscriberClient()
    try:
        got: list[Any] = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            pulled = subscriber.pull(
                subscription=pubsub_subscription.path, max_messages=10, timeout=5
            )
            got += pulled.received_messages
    finally:
        subscriber.close()
    [received] = got
    attributes = dict(received.message.attributes)
    stable = forwarding.idempotency_key("topic", "shop", key)
    assert len(stable) > 1024
    assert attributes["message-id"] == "sha256:" + hashlib.sha256(stable.encode()).hexdigest()
    assert attributes["X-Webhook-Source"] == "shop"


# -- SQS -----------------------------------------------------------------------


def test_sqs_fifo_forward_of_a_source_sqs_cannot_take_as_a_group_id_sends_its_digest(
    make_app,
    clock,
    make_worker,
    sqs_endpoint,  # noqa: F811
):
    # A MessageGroupId takes 1-128 ASCII letters, digits and punctuation:
    # SQS refuses "my shop" (a space), and would make every delivery of the
    # source go dead (moto does not check; what is sent is checked here).
    queue = SqsQueue(sqs_endpoint, f"wr-test-fifo-{uuid.uuid4().hex[:8]}", fifo=True)
    queue.create()
    try:
        path = queue.url.removeprefix(sqs_endpoint)
        bus = forward(
            "queue",
            f"sqs://sqs.eu-west-1.amazonaws.com{path}",
            endpoint_url=sqs_endpoint,
            timeout_seconds=2,
        )
        config = config_with([bus])
        config["sources"] = {"my shop": config["sources"]["shop"]}
        app = make_app(config, **FAST)
        store_event(app, clock, dedup_key="evt-1", source="my shop")
        store_event(app, clock, dedup_key="evt-2", source="my shop")
        assert drain(app, make_worker(app, clock)) == ["delivered", "delivered"]
        messages = queue.receive_all(queue.url)
        assert [m["MessageAttributes"]["message-id"]["StringValue"] for m in messages] == [
            forwarding.idempotency_key("queue", "my shop", "evt-1"),
            forwarding.idempotency_key("queue", "my shop", "evt-2"),
        ]
        groups = {m["Attributes"]["MessageGroupId"] for m in messages}
        assert groups == {hashlib.sha256(b"my shop").hexdigest()}
    finally:
        queue.delete()


# -- NATS JetStream --------------------------------------------------------------


def test_nats_forward_larger_than_the_stream_or_the_server_takes_goes_dead_at_once(
    make_app, clock, make_worker, jetstream
):
    # Neither the stream's max_msg_size nor the server's max_payload (1 MB)
    # lets any attempt through: dead at once, not retried to the limit.
    from nats.js.api import StreamConfig

    async def limit(nc: Any) -> None:
        js = nc.jetstream()
        await js.update_stream(
            StreamConfig(name=jetstream.name, subjects=[f"{jetstream.prefix}.>"], max_msg_size=4096)
        )

    jetstream.run(limit)
    stream = forward("stream", jetstream.url, subject=f"{jetstream.prefix}.stripe")
    app = make_app(config_with([stream]), **FAST)
    past_stream = store_event(app, clock, dedup_key="evt-1", data={"pad": "x" * 5000})
    past_server = store_event(app, clock, dedup_key="evt-2", body=b"x" * (1024 * 1024 + 1))
    small = store_event(app, clock, dedup_key="evt-3")
    assert drain(app, make_worker(app, clock)) == ["dead", "dead", "delivered"]
    row = delivery(app, past_stream, "stream")
    assert (row["state"], row["attempts"]) == ("dead", 1)
    assert "larger than the stream" in row["last_error"]
    row = delivery(app, past_server, "stream")
    assert (row["state"], row["attempts"]) == ("dead", 1)
    assert "max_payload" in row["last_error"]
    assert delivery(app, small, "stream")["state"] == "delivered"


def test_sqs_forward_whose_answer_is_lost_is_sent_once_per_attempt(
    make_app,
    clock,
    make_worker,
    sqs_queue,  # noqa: F811
):
    # botocore's max_attempts counts retries: 1 meant a second send, hidden
    # inside one delivery attempt, whenever the first answer was lost, and
    # an attempt lasting twice the forward's timeout.
    endpoint = sqs_queue.endpoint
    with Relay(int(endpoint.rsplit(":", 1)[1])) as relay:
        relayed = f"http://127.0.0.1:{relay.port}"
        path = sqs_queue.url.removeprefix(endpoint)
        bus = forward(
            "queue",
            f"sqs://sqs.eu-west-1.amazonaws.com{path}",
            endpoint_url=relayed,
            timeout_seconds=2,
        )
        app = make_app(config_with([bus]), **FAST)
        event_id = store_event(app, clock, dedup_key="evt-1")
        relay.hold()  # SQS takes the message; its answer is dropped
        assert drain(app, make_worker(app, clock)) == ["retry"]
    row = delivery(app, event_id, "queue")
    assert (row["state"], row["attempts"]) == ("pending", 1)
    assert _wait_for(lambda: sqs_queue.counts()[0] >= 1)
    messages = sqs_queue.receive_all(sqs_queue.url)
    assert len(messages) == 1, messages


# -- RabbitMQ ------------------------------------------------------------------


def test_amqp_forward_past_the_brokers_max_message_size_is_refused_and_the_next_is_sent(
    amqp_queue,
):
    # RabbitMQ closes the channel (406 PRECONDITION_FAILED) of a message past
    # its max_message_size (128 MiB before 4.0, 16 MiB since): no attempt
    # gets through, so it must not be retried to the attempt limit. Called
    # as the worker calls it (forwarding.send): 128 MiB stored in each
    # database to go through the worker would make the test a slow one.
    [bus] = parse_forwards(
        [
            {
                "name": "bus",
                "url": amqp_queue.url,
                "exchange": "",
                "routing_key": amqp_queue.name,
                "timeout_seconds": 10,
            }
        ],
        "test",
    )

    big = forwarding.send(None, "bus", bus, outgoing("evt-1", b"x" * (128 * 1024 * 1024 + 1)))
    assert (big.ok, big.retryable) == (False, False)
    assert "larger than configured max size" in (big.error or "")
    small = forwarding.send(None, "bus", bus, outgoing("evt-2", b"{}"))
    assert small.ok, small.error
    [(props, body)] = amqp_queue.take_all(amqp_queue.name)
    assert (props.message_id, body) == ("bus:shop:evt-2", b"{}")


def test_a_publisher_that_raises_unexpectedly_is_a_retry_with_its_error_never_a_held_lease(
    make_app, clock, make_worker, monkeypatch, caplog
):
    # A client may raise what its publisher does not expect (a bug, a new
    # exception in a library upgrade): the attempt is a retry with the error
    # on the delivery, and the worker goes on, rather than the exception
    # ending the attempt with the delivery leased until its lease ends.
    from webhook_receiver.processing import publishers

    def broken(_forward: Any, _message: Any) -> None:
        raise TypeError("an unforeseen failure for redis://:hunter2@127.0.0.1:6379/0")

    url = "redis://:hunter2@127.0.0.1:6379/0"
    app = make_app(
        config_with([forward("stream", url, stream=f"fwd-{uuid.uuid4().hex[:8]}")]), **FAST
    )
    event_id = store_event(app, clock, dedup_key="evt-1")
    monkeypatch.setitem(publishers._BY_SCHEME, "redis", broken)
    assert drain(app, make_worker(app, clock)) == ["retry"]
    row = delivery(app, event_id, "stream")
    assert (row["state"], row["attempts"], row["lease_token"]) == ("pending", 1, None)
    assert row["last_error"].startswith("TypeError: an unforeseen failure")
    assert "hunter2" not in row["last_error"]
    assert "hunter2" not in caplog.text
    assert [
        r for r in caplog.records if r.levelname == "ERROR" and "unexpectedly" in r.getMessage()
    ]
