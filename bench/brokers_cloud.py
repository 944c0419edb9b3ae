"""SQS and Pub/Sub rounds for ``python -m bench.brokers`` (see bench/brokers.py).

SQS: moto's server as the tests start it (tests/sqs_server.py), or the one
at ``BENCH_SQS_ENDPOINT``; one queue per round, given the ``n`` messages
again before each run (the same keys: the second stored run's are all
redeliveries). Pub/Sub: the emulator as the tests start it
(tests/pubsub_emulator.py), or the one at ``BENCH_PUBSUB_EMULATOR_HOST``;
one topic per round with a subscription per run, made before the ``n``
messages are published, so that each run reads all of them (the ``again``
run's are redeliveries of the ``unique`` run's keys).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

RUNS = (("bare", True), ("unique", False), ("again", False), ("bare-after", True))
PROJECT = "wr-bench"


def sqs_times(
    db_url: str,
    n: int,
    size: int,
    make_app: Callable[[str, dict[str, Any]], Any],
    consume: Callable[..., float],
    body: Callable[[str, int], bytes],
) -> list[float]:
    """Seconds for each of RUNS, the queue given the ``n`` messages before each."""
    from tests import sqs_server

    endpoint = os.environ.get("BENCH_SQS_ENDPOINT") or sqs_server.endpoint()
    os.environ.update(sqs_server.CREDENTIALS)
    client = sqs_server.client(endpoint)
    name = f"wr-bench-{uuid.uuid4().hex[:8]}"
    url = client.create_queue(QueueName=name)["QueueUrl"]
    try:
        times = []
        for _run, is_bare in RUNS:
            for start in range(0, n, 10):
                entries = []
                for i in range(start, min(start + 10, n)):
                    key = f"{name}-evt-{i}"
                    attributes = {"message-id": key, "type": "order.paid"}
                    attributes["content-type"] = "application/json"
                    entries.append(
                        {
                            "Id": str(i - start),
                            "MessageBody": body(key, i).decode(),
                            "MessageAttributes": {
                                k: {"DataType": "String", "StringValue": v}
                                for k, v in attributes.items()
                            },
                        }
                    )
                client.send_message_batch(QueueUrl=url, Entries=entries)
            table = {
                "provider": "sqs",
                "queue_url": url,
                "region": sqs_server.REGION,
                "endpoint_url": endpoint,
                "dedup_key": "attribute:message-id",
                "event_type": "attribute:type",
                "batch": size,
            }
            times.append(consume(make_app(db_url, table), n, bare=is_bare))
        return times
    finally:
        client.delete_queue(QueueUrl=url)


def pubsub_times(
    db_url: str,
    n: int,
    size: int,
    make_app: Callable[[str, dict[str, Any]], Any],
    consume: Callable[..., float],
    body: Callable[[str, int], bytes],
) -> list[float]:
    """Seconds for each of RUNS, each its own subscription of the topic's ``n`` messages."""
    from google.cloud import pubsub_v1

    from tests import pubsub_emulator

    os.environ["PUBSUB_EMULATOR_HOST"] = (
        os.environ.get("BENCH_PUBSUB_EMULATOR_HOST") or pubsub_emulator.host()
    )
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    name = f"wr-bench-{uuid.uuid4().hex[:8]}"
    topic = f"projects/{PROJECT}/topics/{name}"
    paths = [f"projects/{PROJECT}/subscriptions/{name}-{run}" for run, _ in RUNS]
    publisher.create_topic(name=topic)
    try:
        for path in paths:
            subscriber.create_subscription(name=path, topic=topic, ack_deadline_seconds=60)
        for start in range(0, n, 1000):
            futures = [
                publisher.publish(
                    topic,
                    body(f"{name}-evt-{i}", i),
                    **{
                        "message-id": f"{name}-evt-{i}",
                        "type": "order.paid",
                        "content-type": "application/json",
                    },
                )
                for i in range(start, min(start + 1000, n))
            ]
            for future in futures:
                future.result(timeout=60)
        times = []
        for path, (_run, is_bare) in zip(paths, RUNS, strict=True):
            table = {
                "provider": "pubsub",
                "project": PROJECT,
                "subscription": path,
                "dedup_key": "attribute:message-id",
                "event_type": "attribute:type",
                "batch": size,
            }
            times.append(consume(make_app(db_url, table), n, bare=is_bare))
        return times
    finally:
        for path in paths:
            subscriber.delete_subscription(subscription=path)
        publisher.delete_topic(topic=topic)
        publisher.stop()
        subscriber.close()
