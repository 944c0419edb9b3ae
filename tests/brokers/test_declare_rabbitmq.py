"""``flask brokers declare`` for RabbitMQ: a queue that exists with other arguments."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pika
import pika.exceptions
import pytest

SOURCE = "orders"


@pytest.fixture
def queue(rabbit_url: str) -> Iterator[str]:
    name = f"wr-declare-{uuid.uuid4().hex[:10]}"
    yield name
    channel = pika.BlockingConnection(pika.URLParameters(rabbit_url)).channel()
    for dead_or_not in (name, f"{name}.dead"):
        channel.queue_delete(dead_or_not)
    channel.exchange_delete(f"{name}.dlx")
    channel.connection.close()


def _exists(url: str, declare_passively) -> bool:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        declare_passively(connection.channel())
        return True
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404
        return False
    finally:
        connection.close()


def test_a_queue_with_other_arguments_is_refused_before_anything_is_made(
    make_app, rabbit_url, queue
):
    # The queue refuses declare's arguments: the dead-letter exchange and
    # queue made for it would be left behind, feeding nothing.
    channel = pika.BlockingConnection(pika.URLParameters(rabbit_url)).channel()
    channel.queue_declare(queue, durable=True)  # classic, no dead-letter exchange
    channel.connection.close()
    table = {"provider": "rabbitmq", "url": rabbit_url, "queue": queue}
    app = make_app({"sources": {SOURCE: table}})
    result = app.test_cli_runner().invoke(args=["brokers", "declare"])
    assert result.exit_code == 1, result.output
    assert result.output.splitlines()[-1].startswith(
        f"Error: source {SOURCE}: queue {queue!r} (quorum, dead letters to {queue + '.dlx'!r}) "
        "exists with other settings (PRECONDITION_FAILED - inequivalent arg"
    )
    assert len(result.output.splitlines()) == 1, result.output
    assert not _exists(rabbit_url, lambda ch: ch.exchange_declare(f"{queue}.dlx", passive=True))
    assert not _exists(rabbit_url, lambda ch: ch.queue_declare(f"{queue}.dead", passive=True))
