"""Redis Streams and MQTT rounds for ``python -m bench.brokers`` (see bench/brokers.py).

Redis: one stream filled once per round, read by a consumer group per run
(each group reads the stream from its start): the bare loop, the unique
messages, the same messages again (every one a redelivery), the bare loop
after. MQTT: a private Mosquitto (``max_queued_messages 0``, logging
errors only, as tests/mosquitto.py starts it), a persistent session per
run made before its messages are published with QoS 1; the ``again`` run
is published the same messages.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from .broker_rounds import Round, fresh_name, key

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_times(rnd: Round) -> list[float]:
    """Seconds for each of RUNS over one stream of ``n`` entries."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    stream = fresh_name()

    def source_for(group: str) -> dict[str, Any]:
        client.xgroup_create(stream, group, id="0")
        return {
            "provider": "redis",
            "url": REDIS_URL,
            "stream": stream,
            "group": group,
            "event_type": "field:type",
        }

    try:
        for start in range(0, rnd.n, 1000):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + 1000, rnd.n)):
                fields = {
                    "message_id": key(stream, i),
                    "type": "order.paid",
                    "content_type": "application/json",
                    "body": rnd.body(key(stream, i), i),
                }
                pipe.xadd(stream, fields)  # type: ignore[arg-type]
            pipe.execute()
        return rnd.timed(source_for)
    finally:
        client.delete(stream)


def mqtt_times(rnd: Round) -> list[float]:
    """Seconds for each of RUNS, each its own session given the ``n`` messages."""
    from tests import mosquitto

    server = mosquitto.start(log_everything=False)
    prefix = fresh_name()

    def source_for(run: str) -> dict[str, Any]:
        client_id = f"{prefix}-{run}"
        _open_session(server.port, client_id, f"{prefix}/{run}/#")
        _fill(server.port, f"{prefix}/{run}/orders", prefix, rnd.n, rnd.body)
        return {
            "provider": "mqtt",
            "url": server.url,
            "topics": [f"{prefix}/{run}/#"],
            "client_id": client_id,
            # Not the topic (the default), which is each run's own: the
            # redeliveries would differ in type, conflicts rather than duplicates.
            "event_type": "user_property:type",
        }

    try:
        return rnd.timed(source_for)
    finally:
        mosquitto.stop(server)


def _client(client_id: str = "") -> Any:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    return mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=client_id, protocol=MQTTProtocolVersion.MQTTv5
    )


def _open_session(port: int, client_id: str, topic_filter: str) -> None:
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    client = _client(client_id)
    properties = Properties(PacketTypes.CONNECT)
    properties.SessionExpiryInterval = 3600
    subscribed = threading.Event()
    client.on_subscribe = lambda *_args: subscribed.set()
    client.connect("127.0.0.1", port, clean_start=False, properties=properties)
    client.loop_start()
    client.subscribe(topic_filter, qos=1)
    if not subscribed.wait(10):
        raise RuntimeError("no SUBACK")
    client.disconnect()
    client.loop_stop()


def _fill(port: int, topic: str, prefix: str, n: int, body: Callable[[str, int], bytes]) -> None:
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    client = _client()
    client.max_inflight_messages_set(1000)
    client.connect("127.0.0.1", port)
    client.loop_start()
    infos = []
    for i in range(n):
        properties = Properties(PacketTypes.PUBLISH)
        properties.ContentType = "application/json"
        properties.UserProperty = [("message-id", key(prefix, i)), ("type", "order.paid")]
        infos.append(client.publish(topic, body(key(prefix, i), i), qos=1, properties=properties))
    for info in infos:
        info.wait_for_publish(60)
    client.disconnect()
    client.loop_stop()
