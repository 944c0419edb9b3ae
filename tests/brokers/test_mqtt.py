"""The MQTT 5 consumer against the tests' Mosquitto: what the contract suite does not cover.

A message's topic, user properties and QoS kept with its event; the topic
as its type by default; a consumer killed before its PUBACKs gets the
messages again on reconnecting (the broker sends them with DUP set), and
each is stored once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import uuid
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from sqlalchemy import select

from webhook_receiver.brokers.mqtt_setup import declare_mqtt
from webhook_receiver.config import ConfigError, ForwardConfig, parse
from webhook_receiver.config.forwards import parse_forwards
from webhook_receiver.extensions import db
from webhook_receiver.models import Event
from webhook_receiver.processing import publishers

from ..helpers import rows
from ..helpers.brokers import FORWARDED, assert_forwarded, run_worked_example
from . import worked_examples
from .conftest import (
    consuming,
    count_events,
    dead_letter_count,
    duplicate_total,
    start_consume,
    stop,
    wait_until,
)
from .mqtt_fixtures import MqttTopics, mqtt_source
from .mqtt_fixtures import client as mqtt_client
from .running import hold_writers, key_counts, log_tail, terminate, toml

SOURCE = "devices"


def _message(n: int) -> tuple[str, bytes, list[tuple[str, str]]]:
    return "sensor-7", json.dumps({"reading": n}).encode(), [("message-id", f"r-{n}")]


def test_a_message_is_stored_with_its_topic_user_properties_and_qos(make_app, mqtt_topics):
    table = mqtt_source(mqtt_topics)
    del table["event_type"]  # the default: the topic
    app = make_app({"sources": {SOURCE: table}})
    level, body, props = _message(1)
    mqtt_topics.publish([(level, body, [*props, ("X-Request-Id", "req-1"), ("site", "a")])])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        assert wait_until(lambda: mqtt_topics.acked() == 1, 10)
    with app.app_context():
        event = db.session.execute(select(Event)).scalar_one()
        db.session.expunge(event)
        db.session.rollback()
    topic = f"{mqtt_topics.prefix}/sensor-7/events"
    assert (event.dedup_key, event.event_type, event.body) == ("r-1", topic, body)
    assert event.content_type == "application/json"
    assert event.correlation_id == "req-1"
    assert ["site", "a"] in event.headers and ["message-id", "r-1"] in event.headers
    assert event.meta["topic"] == topic and event.meta["qos"] == 1
    assert event.meta["client_id"] == mqtt_topics.client_id and event.meta["retain"] is False


def test_a_consumer_killed_before_its_pubacks_gets_them_again_on_reconnecting(
    make_app, db_url, tmp_path, mqtt_topics: MqttTopics
):
    sources = {SOURCE: mqtt_source(mqtt_topics)}
    app = make_app({"sources": sources})
    process, log = start_consume(db_url, toml(sources), tmp_path)
    try:
        assert wait_until(lambda: "consuming" in log.read_text(), 30), log_tail(log)
        release = hold_writers(db_url)  # received, but never committed: no PUBACK
        try:
            mqtt_topics.publish([_message(n) for n in range(20)])
            assert wait_until(lambda: mqtt_topics.sent() == 20, 30), mqtt_topics.broker.tail()
            assert mqtt_topics.acked() == 0
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        finally:
            release()
    finally:
        stop(process)
    assert count_events(app) == 0
    process, log = start_consume(db_url, toml(sources), tmp_path)
    try:
        assert wait_until(lambda: count_events(app) == 20, 30), log_tail(log)
        assert wait_until(lambda: mqtt_topics.acked() == 20, 10), mqtt_topics.broker.tail()
    finally:
        code = terminate(process, log)
    assert code == 0, log_tail(log)
    # Sent again by the broker, as redeliveries, to the same session.
    assert mqtt_topics.sent(redelivered=True) == 20
    assert "session resumed" in log.read_text()
    keys = key_counts(db_url)
    assert set(keys) == {f"r-{n}" for n in range(20)} and max(keys.values()) == 1


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ({"topics": []}, "topics must be a non-empty list of MQTT topic filters"),
        ({"topics": ["a/#/b"]}, "topics must be a non-empty list of MQTT topic filters"),
        ({"topics": ["a/b+"]}, "topics must be a non-empty list of MQTT topic filters"),
        ({"dead_letter_topic": "dead/+"}, "dead_letter_topic must be a topic name"),
        ({"dead_letter_topic": "devices/dead/events"}, "is inside topics (devices/+/events)"),
        ({"dedup_key": "header:message-id"}, "is not 'user_property:<name>'"),
        ({"dedup_key": "topic"}, "'topic' is the event type of an MQTT source only"),
        ({"url": "tcp://127.0.0.1:1883"}, "url must be a mqtt:// or mqtts:// URL"),
        ({"qos": 2}, "unknown key(s) for provider mqtt: qos"),
    ],
)
def test_an_mqtt_source_that_cannot_work_is_refused_when_loaded(table, problem):
    base = {"provider": "mqtt", "url": "mqtt://127.0.0.1:1883", "topics": ["devices/+/events"]}
    with pytest.raises(ConfigError) as refused:
        parse({"sources": {SOURCE: {**base, **table}}}, providers=())
    assert problem in str(refused.value)


def test_an_mqtt_source_s_defaults():
    table = {"provider": "mqtt", "url": "mqtt://u:secret@h", "topics": ["devices/#"]}
    source = parse({"sources": {SOURCE: table}}, providers=()).brokers[SOURCE]
    assert (source.dedup_key, source.event_type, source.client_id, source.batch) == (
        "user_property:message-id",
        "topic",
        f"webhook-receiver-{SOURCE}",
        100,
    )
    assert "secret" not in repr(source)


def test_the_docs_worked_example_runs_as_written(make_app, mqtt_broker):
    name, table, commands = worked_examples.example("MQTT 5")
    prefix = f"wr-test-{uuid.uuid4().hex[:10]}"
    swap = {
        table["dead_letter_topic"]: f"{prefix}-dead",
        f"'{table['client_id']}'": f"'{prefix}-consumer'",
        "devices/": f"{prefix}/",
    }
    table = {
        **table,
        "url": mqtt_broker.url,
        "topics": [t.replace("devices/", f"{prefix}/") for t in table["topics"]],
        "client_id": f"{prefix}-consumer",
        "dead_letter_topic": f"{prefix}-dead",
    }
    app = make_app({"sources": {name: table}})
    run_worked_example(
        app, name, commands, lambda args, lines: worked_examples.run(app, args, lines, swap)
    )
    [event] = rows(app)
    assert (event.dedup_key, event.event_type) == ("r-1", f"{prefix}/sensor-7/events")
    assert event.body == b'{"reading": 21.5}'


def _forward(url: str, topic: str, timeout: float = 10) -> ForwardConfig:
    table = {"name": "bus", "url": url, "topic": topic, "timeout_seconds": timeout}
    [forward] = parse_forwards([table], "test")
    return forward


def test_a_forward_publishes_with_qos1_what_an_mqtt_source_reads_as_one_event(
    make_app, mqtt_topics
):
    forward = _forward(mqtt_topics.url, f"{mqtt_topics.prefix}/bus/events")
    publishers.publish(forward, FORWARDED)
    publishers.publish(forward, FORWARDED)  # a worker killed before marking it done
    table = mqtt_source(mqtt_topics, event_type="user_property:type")
    del table["dedup_key"]  # the default: user_property:message-id
    app = make_app({"sources": {SOURCE: table}})
    with consuming(app, SOURCE):
        assert wait_until(lambda: mqtt_topics.acked() == 2, 30)
    [event] = rows(app)
    assert_forwarded(event)


def test_a_forward_no_session_subscribes_to_is_a_retryable_failure(mqtt_topics):
    forward = _forward(mqtt_topics.url, f"{mqtt_topics.prefix}-nobody/events")
    with pytest.raises(publishers.PublishError) as failed:
        publishers.publish(forward, FORWARDED)
    assert "no session subscribes" in str(failed.value)


def test_a_forward_to_a_broker_that_does_not_answer_is_a_retryable_failure():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    forward = _forward(f"mqtt://user:secret@127.0.0.1:{port}", "jobs", timeout=1)
    with pytest.raises(publishers.PublishError) as failed:
        publishers.publish(forward, FORWARDED)
    assert "secret" not in str(failed.value)


def test_a_dead_letter_no_session_subscribes_to_is_not_acknowledged_away(make_app, mqtt_topics):
    # The broker answers a copy to a topic nobody subscribes to with PUBACK
    # 0x10 (no matching subscribers) and keeps nothing: the original must not
    # be acknowledged then, or it is lost. It comes again on the next
    # connection, and is dead-lettered once a session takes the topic.
    nobody = f"{mqtt_topics.prefix}-nobody/events"
    app = make_app({"sources": {SOURCE: mqtt_source(mqtt_topics, dead_letter_topic=nobody)}})
    level, body, props = _message(1)
    mqtt_topics.publish([(level, body, props), ("sensor-8", b'{"no": "key"}', [])])
    got: list[tuple[bytes, dict[str, str]]] = []
    reader = mqtt_client(f"{mqtt_topics.prefix}-nobody-reader")
    reader.on_message = lambda _c, _u, m: got.append(
        (m.payload, dict(getattr(m.properties, "UserProperty", []) or []))
    )
    subscribed = threading.Event()
    reader.on_subscribe = lambda *_args: subscribed.set()
    try:
        with consuming(app, SOURCE):
            assert wait_until(lambda: count_events(app) == 1, 30)
            # Not acknowledged: the broker sends it again on the consumer's next connection.
            assert wait_until(lambda: mqtt_topics.sent(redelivered=True) >= 1, 15)
            assert got == []
            reader.connect("127.0.0.1", mqtt_topics.broker.port)
            reader.loop_start()
            reader.subscribe(nobody, qos=1)
            assert subscribed.wait(10)
            assert wait_until(lambda: len(got) == 1, 30)
            assert wait_until(lambda: dead_letter_count(app, SOURCE, "dedup-key-missing") == 1, 10)
    finally:
        reader.disconnect()
        reader.loop_stop()
    [(payload, properties)] = got
    assert payload == b'{"no": "key"}' and properties["dead-letter-reason"] == "dedup-key-missing"
    assert count_events(app) == 1


def test_a_retained_message_is_not_sent_again_on_each_connection(make_app, mqtt_topics):
    # The consumer subscribes again on each connection to its session: with
    # retain handling 0 the broker sent every retained message on its topics
    # again each time, a duplicate counted (or a poison dead-lettered again)
    # per connection. Retain handling 1: only to a subscription that is new.
    app = make_app({"sources": {SOURCE: mqtt_source(mqtt_topics)}})
    topic = f"{mqtt_topics.prefix}/sensor-7/events"
    publisher = mqtt_client(f"{mqtt_topics.prefix}-retainer")
    publisher.connect("127.0.0.1", mqtt_topics.broker.port)
    publisher.loop_start()
    try:
        level, body, props = _message(1)
        properties = Properties(PacketTypes.PUBLISH)
        properties.UserProperty = props
        info = publisher.publish(topic, body, qos=1, retain=True, properties=properties)
        info.wait_for_publish(10)
        try:
            for _ in range(3):
                with consuming(app, SOURCE):
                    assert wait_until(lambda: count_events(app) == 1, 30)
                    wait_until(lambda: mqtt_topics.sent() > 1, 1)
                    assert wait_until(lambda: mqtt_topics.acked() == mqtt_topics.sent(), 10)
        finally:
            publisher.publish(topic, b"", qos=1, retain=True).wait_for_publish(10)
    finally:
        publisher.disconnect()
        publisher.loop_stop()
    assert mqtt_topics.sent() == 1
    assert duplicate_total(app) == 0


def test_declare_run_again_takes_none_of_the_messages_waiting_in_the_session(make_app, mqtt_topics):
    # `brokers declare` resumes the source's session (clean start off) to
    # subscribe it: the broker sends it the messages waiting there, which
    # paho acknowledged by itself, and the consumer never had them.
    app = make_app({"sources": {SOURCE: mqtt_source(mqtt_topics)}})
    mqtt_topics.publish([_message(n) for n in range(5)])
    said: list[str] = []
    declare_mqtt(app.config["FILE_CONFIG"].brokers[SOURCE], said.append)
    assert said == [
        f"session {mqtt_topics.client_id!r} ({mqtt_topics.topic_filter}, QoS 1): exists"
    ]
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 5, 15)
        assert wait_until(lambda: mqtt_topics.acked() == 5, 10)


@pytest.fixture
def small_packets(monkeypatch) -> Any:
    """Topics on a Mosquitto of their own whose max_packet_size is 2,048 bytes."""
    import subprocess
    from pathlib import Path

    from .. import mosquitto

    popen = subprocess.Popen

    def with_limit(args: list[str], **options: Any) -> Any:
        config = Path(args[2])
        config.write_text(config.read_text() + "max_packet_size 2048\n")
        return popen(args, **options)

    with monkeypatch.context() as patched:
        patched.setattr(subprocess, "Popen", with_limit)
        broker = mosquitto.start()
    topics = MqttTopics(broker, f"wr-test-{uuid.uuid4().hex[:10]}")
    try:
        topics.start_collector()
        topics.open_session()
        yield topics
        topics.close()
    finally:
        mosquitto.stop(broker)


@pytest.mark.parametrize("fits", ["without-its-reason", "never"])
def test_a_poison_message_whose_copy_exceeds_the_maximum_packet_size_does_not_loop(
    make_app, small_packets, caplog, fits
):
    # The broker takes packets of 2,048 bytes at most (CONNACK's Maximum
    # Packet Size): a message near it, its copy's added user properties
    # past it. Mosquitto dropped the connection on the copy, and the
    # original came again on the next one, for ever.
    topics = small_packets
    # The original: 72 bytes beside the pad; its copy 92 more with both added
    # user properties, 52 more with dead-letter-topic alone.
    pad = 1950 if fits == "never" else 1900
    poison = ("sensor-8", json.dumps({"pad": "x" * pad}).encode(), [])
    topics.publish([poison, _message(1)])
    app = make_app({"sources": {SOURCE: mqtt_source(topics)}})
    caplog.set_level("WARNING", "webhook_receiver.brokers")
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "dedup-key-missing") == 1, 10)
        assert wait_until(lambda: topics.acked() == 2, 10)
    assert topics.sent(redelivered=True) == 0
    assert "broker unavailable" not in caplog.text
    if fits == "never":
        assert topics.dead_letters() == []
        [refused] = [r for r in caplog.records if "was refused" in r.getMessage()]
        assert refused.levelname == "ERROR"
    else:
        [(payload, properties)] = topics.dead_letters()
        assert payload == poison[1]
        assert "dead-letter-reason" not in properties
        assert "went without its dead-letter-reason" in caplog.text
