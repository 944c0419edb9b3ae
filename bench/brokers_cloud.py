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
from typing import Any

from .broker_rounds import RUNS, Round, fresh_name, key

PROJECT = "wr-bench"


def sqs_times(rnd: Round) -> list[float]:
    """Seconds for each of RUNS, the queue given the ``n`` messages before each."""
    from tests import sqs_server

    endpoint = os.environ.get("BENCH_SQS_ENDPOINT") or sqs_server.endpoint()
    os.environ.update(sqs_server.CREDENTIALS)
    client = sqs_server.client(endpoint)
    name = fresh_name()
    url = client.create_queue(QueueName=name)["QueueUrl"]

    def source_for(_run: str) -> dict[str, Any]:
        for start in range(0, rnd.n, 10):
            entries = []
            for i in range(start, min(start + 10, rnd.n)):
                attributes = {"message-id": key(name, i), "type": "order.paid"}
                attributes["content-type"] = "application/json"
                entries.append(
                    {
                        "Id": str(i - start),
                        "MessageBody": rnd.body(key(name, i), i).decode(),
                        "MessageAttributes": {
                            k: {"DataType": "String", "StringValue": v}
                            for k, v in attributes.items()
                        },
                    }
                )
            client.send_message_batch(QueueUrl=url, Entries=entries)
        return {
            "provider": "sqs",
            "queue_url": url,
            "region": sqs_server.REGION,
            "endpoint_url": endpoint,
            "dedup_key": "attribute:message-id",
            "event_type": "attribute:type",
        }

    try:
        return rnd.timed(source_for)
    finally:
        client.delete_queue(QueueUrl=url)


def pubsub_times(rnd: Round) -> list[float]:
    """Seconds for each of RUNS, each its own subscription of the topic's ``n`` messages."""
    from google.cloud import pubsub_v1

    from tests import pubsub_emulator

    os.environ["PUBSUB_EMULATOR_HOST"] = (
        os.environ.get("BENCH_PUBSUB_EMULATOR_HOST") or pubsub_emulator.host()
    )
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    name = fresh_name()
    topic = f"projects/{PROJECT}/topics/{name}"
    paths = {run: f"projects/{PROJECT}/subscriptions/{name}-{run}" for run, _ in RUNS}
    publisher.create_topic(name=topic)
    try:
        for path in paths.values():
            subscriber.create_subscription(name=path, topic=topic, ack_deadline_seconds=60)
        for start in range(0, rnd.n, 1000):
            futures = [
                publisher.publish(
                    topic,
                    rnd.body(key(name, i), i),
                    **{
                        "message-id": key(name, i),
                        "type": "order.paid",
                        "content-type": "application/json",
                    },
                )
                for i in range(start, min(start + 1000, rnd.n))
            ]
            for future in futures:
                future.result(timeout=60)
        return rnd.timed(
            lambda run: {
                "provider": "pubsub",
                "project": PROJECT,
                "subscription": paths[run],
                "dedup_key": "attribute:message-id",
                "event_type": "attribute:type",
            }
        )
    finally:
        for path in paths.values():
            subscriber.delete_subscription(subscription=path)
        publisher.delete_topic(topic=topic)
        publisher.stop()
        subscriber.close()
