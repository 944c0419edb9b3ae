"""``flask brokers declare`` and ``flask brokers publish`` against the real RabbitMQ and NATS."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import nats
import nats.js.errors
import pika
import pytest
from nats.js.api import StreamConfig

from webhook_receiver.extensions import db
from webhook_receiver.models import Event

from .conftest import consuming, count_events, wait_until

SOURCE = "tour"


def _cli(app, *args):
    return app.test_cli_runner().invoke(args=["brokers", *args])


def _ok(result) -> list[str]:
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def _one_line_error(result, exit_code: int = 1) -> str:
    assert result.exit_code == exit_code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


def _stored(app) -> list[tuple[str, str | None, str | None, bytes]]:
    with app.app_context():
        rows = db.session.query(Event).order_by(Event.id).all()
        found = [(e.dedup_key, e.event_type, e.content_type, bytes(e.body)) for e in rows]
        db.session.rollback()
        return found


# -- RabbitMQ -----------------------------------------------------------------


@dataclass
class Names:
    url: str
    queue: str

    @property
    def dead(self) -> str:
        return f"{self.queue}.dead"

    @property
    def dlx(self) -> str:
        return f"{self.queue}.dlx"

    def channel(self) -> Any:
        return pika.BlockingConnection(pika.URLParameters(self.url)).channel()


@pytest.fixture
def amqp_names(rabbit_url: str) -> Iterator[Names]:
    """A queue name no one uses; the queue, its dead-letter queue and exchange deleted after."""
    names = Names(rabbit_url, f"wr-manage-{uuid.uuid4().hex[:10]}")
    yield names
    channel = names.channel()
    for queue in (names.queue, names.dead):
        channel.queue_delete(queue)
    channel.exchange_delete(names.dlx)
    channel.connection.close()


def _rabbit_app(make_app, names: Names, **extra):
    table = {"provider": "rabbitmq", "url": names.url, "queue": names.queue, **extra}
    return make_app({"sources": {SOURCE: table}})


def test_declare_makes_the_queue_and_its_dead_letters_and_twice_is_fine(make_app, amqp_names):
    app = _rabbit_app(make_app, amqp_names)
    q, dead, dlx = amqp_names.queue, amqp_names.dead, amqp_names.dlx
    assert _ok(_cli(app, "declare")) == [
        f"{SOURCE}: exchange {dlx!r} (fanout): created",
        f"{SOURCE}: queue {dead!r} (quorum, bound to {dlx!r}): created",
        f"{SOURCE}: queue {q!r} (quorum, dead letters to {dlx!r}): created",
    ]
    assert _ok(_cli(app, "declare", SOURCE)) == [
        f"{SOURCE}: exchange {dlx!r} (fanout): exists",
        f"{SOURCE}: queue {dead!r} (quorum, bound to {dlx!r}): exists",
        f"{SOURCE}: queue {q!r} (quorum, dead letters to {dlx!r}): exists",
    ]


def test_the_declared_queue_dead_letters_to_its_dead_letter_queue(make_app, amqp_names):
    app = _rabbit_app(make_app, amqp_names)
    _ok(_cli(app, "declare"))
    _ok(_cli(app, "publish", SOURCE, "--key", "order-1", '{"order": 1}'))
    channel = amqp_names.channel()
    try:
        method, _, _ = channel.basic_get(amqp_names.queue)
        assert method is not None
        # What the consumer does with a conflict or a keyless message.
        channel.basic_nack(method.delivery_tag, requeue=False)

        def dead_lettered() -> bool:
            return channel.queue_declare(amqp_names.dead, passive=True).method.message_count == 1

        assert wait_until(dead_lettered, 10)
        _, props, body = channel.basic_get(amqp_names.dead, auto_ack=True)
        assert (props.message_id, body) == ("order-1", b'{"order": 1}')
    finally:
        channel.connection.close()


def test_a_queue_declared_otherwise_is_named_in_one_line(make_app, amqp_names):
    channel = amqp_names.channel()
    channel.queue_declare(amqp_names.queue, durable=True)  # classic, no dead-letter exchange
    channel.connection.close()
    app = _rabbit_app(make_app, amqp_names)
    error = _one_line_error(_cli(app, "declare"))
    assert f"queue {amqp_names.queue!r} (quorum" in error
    assert "exists with other settings" in error
    assert "inequivalent arg" in error


def test_rabbitmq_publish_then_consume_stores_the_key_and_type(make_app, amqp_names):
    app = _rabbit_app(make_app, amqp_names)
    _ok(_cli(app, "declare"))
    lines = _ok(
        _cli(app, "publish", SOURCE, "--key", "order-42", "--type", "order.created", '{"n": 42}')
    )
    assert lines == [
        f"{SOURCE}: published to queue {amqp_names.queue!r} (confirmed): "
        "message_id 'order-42', type 'order.created'"
    ]
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
    assert _stored(app) == [("order-42", "order.created", "application/json", b'{"n": 42}')]


def test_rabbitmq_publish_sets_the_headers_the_specs_name(make_app, amqp_names):
    app = _rabbit_app(
        make_app, amqp_names, dedup_key="header:X-Order-Id", event_type="header:X-Kind"
    )
    _ok(_cli(app, "declare"))
    lines = _ok(
        _cli(
            app,
            "publish",
            SOURCE,
            "--key",
            "o-7",
            "--type",
            "k",
            "--content-type",
            "text/plain",
            "hi",
        )
    )
    assert lines[0].endswith("X-Order-Id 'o-7', X-Kind 'k'")
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
    assert _stored(app) == [("o-7", "k", "text/plain", b"hi")]


def test_publish_to_a_queue_not_declared_says_to_declare_it(make_app, amqp_names):
    app = _rabbit_app(make_app, amqp_names)
    error = _one_line_error(_cli(app, "publish", SOURCE, "--key", "k", "{}"))
    assert f"queue {amqp_names.queue!r} does not exist" in error
    assert f"flask --app wsgi brokers declare {SOURCE}" in error


def test_a_key_the_source_reads_from_the_body_must_be_in_the_body(make_app, amqp_names):
    app = _rabbit_app(make_app, amqp_names, dedup_key="json:/id")
    _ok(_cli(app, "declare"))
    result = _cli(app, "publish", SOURCE, "--key", "a-1", '{"id": "a-2"}')
    assert "holds 'a-2', not 'a-1'" in _one_line_error(result, exit_code=2)
    result = _cli(app, "publish", SOURCE, '{"no": "id"}')
    assert "the body must carry it there" in _one_line_error(result, exit_code=2)
    result = _cli(app, "publish", SOURCE, "--key", "plain text", "plain text")
    assert "reads its dedup key from the body (json:/id)" in _one_line_error(result, exit_code=2)
    lines = _ok(_cli(app, "publish", SOURCE, "--key", "a-2", '{"id": "a-2"}'))
    assert lines[0].endswith("dedup_key 'a-2' at json:/id")
    assert _ok(_cli(app, "publish", SOURCE, '{"id": 3}'))[0].endswith("dedup_key '3' at json:/id")
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 2, 30)
    assert [row[0] for row in _stored(app)] == ["a-2", "3"]


def test_without_a_key_the_source_reads_from_the_message_publish_refuses(make_app, amqp_names):
    app = _rabbit_app(make_app, amqp_names)
    result = _cli(app, "publish", SOURCE, "{}")
    error = _one_line_error(result, exit_code=2)
    assert f"give --key: source {SOURCE} reads its dedup key from property:message_id" in error


@pytest.mark.parametrize("provider", ["rabbitmq", "nats"])
def test_a_broker_that_is_not_there_is_one_line(make_app, provider):
    url = "amqp://guest:pw@127.0.0.1:1/%2F" if provider == "rabbitmq" else "nats://127.0.0.1:1"
    where = {"queue": "q"} if provider == "rabbitmq" else {"stream": "S"}
    app = make_app({"sources": {SOURCE: {"provider": provider, "url": url, **where}}})
    for args in (("declare",), ("publish", SOURCE, "--key", "k", "--subject", "S", "{}")):
        error = _one_line_error(_cli(app, *args))
        assert error.startswith(f"Error: source {SOURCE}: cannot reach ")
        assert "pw" not in error


def test_an_unknown_source_or_none_at_all_is_named(make_app):
    app = make_app({"sources": {SOURCE: {"provider": "nats", "url": "nats://x", "stream": "S"}}})
    assert "no broker source named 'nope'" in _one_line_error(_cli(app, "declare", "nope"))
    bare = make_app({})
    assert "no broker source" in _one_line_error(_cli(bare, "declare"))


def test_a_kafka_source_is_never_declared_or_published_through_another_brokers_path(make_app):
    # No broker is contacted: the command names Kafka's own tools instead.
    table = {
        "provider": "kafka",
        "bootstrap_servers": "127.0.0.1:9",
        "topics": ["orders"],
        "dedup_key": "header:message-id",
    }
    app = make_app({"sources": {SOURCE: table}})
    assert "kafka-topics.sh" in _one_line_error(_cli(app, "declare", SOURCE))
    published = _cli(app, "publish", SOURCE, "--key", "k1", "{}")
    assert "kafka-console-producer.sh" in _one_line_error(published)


# -- NATS JetStream -------------------------------------------------------------


@dataclass
class StreamNames:
    url: str
    stream: str
    prefix: str

    @property
    def dead_stream(self) -> str:
        return f"{self.stream}_DEAD"

    @property
    def dead_subject(self) -> str:
        return f"dead.{self.prefix}"

    def run(self, coro_fn: Any) -> Any:
        async def main() -> Any:
            nc = await nats.connect(self.url, connect_timeout=2)
            try:
                return await coro_fn(nc.jetstream())
            finally:
                await nc.close()

        return asyncio.run(main())

    def info(self, name: str) -> Any:
        async def go(js: Any) -> Any:
            try:
                return await js.stream_info(name)
            except nats.js.errors.NotFoundError:
                return None

        return self.run(go)


@pytest.fixture
def stream_names(nats_url: str) -> Iterator[StreamNames]:
    """A stream name and subject prefix no one uses; the streams deleted after."""
    tag = uuid.uuid4().hex[:10]
    names = StreamNames(nats_url, f"WRMANAGE_{tag}", f"wrmanage-{tag}")
    yield names

    async def clean(js: Any) -> None:
        for name in (names.stream, names.dead_stream):
            try:
                await js.delete_stream(name)
            except nats.js.errors.NotFoundError:
                pass

    names.run(clean)


def _nats_app(make_app, names: StreamNames, **extra):
    table = {
        "provider": "nats",
        "url": names.url,
        "stream": names.stream,
        "filter_subject": f"{names.prefix}.>",
        "dead_letter_subject": names.dead_subject,
        **extra,
    }
    return make_app({"sources": {SOURCE: {k: v for k, v in table.items() if v is not None}}})


def test_declare_makes_the_stream_and_its_dead_letter_stream_and_twice_is_fine(
    make_app, stream_names
):
    app = _nats_app(make_app, stream_names)
    s, dead = stream_names.stream, stream_names.dead_stream
    assert _ok(_cli(app, "declare")) == [
        f"{SOURCE}: stream {s!r} ({stream_names.prefix}.>): created",
        f"{SOURCE}: stream {dead!r} ({stream_names.dead_subject}): created",
    ]
    assert _ok(_cli(app, "declare")) == [
        f"{SOURCE}: stream {s!r} ({stream_names.prefix}.>): exists",
        f"{SOURCE}: stream {dead!r} ({stream_names.dead_subject}): exists",
    ]


def test_the_dead_letter_stream_takes_the_dead_letter_subject(make_app, stream_names):
    app = _nats_app(make_app, stream_names)
    _ok(_cli(app, "declare"))

    async def go(js: Any) -> tuple[str, str]:
        holder = await js.find_stream_name_by_subject(stream_names.dead_subject)
        ack = await js.publish(stream_names.dead_subject, b"dead")
        return holder, ack.stream

    assert stream_names.run(go) == (stream_names.dead_stream, stream_names.dead_stream)
    assert stream_names.info(stream_names.stream).state.messages == 0


def test_declare_adds_the_filter_subject_to_a_stream_that_lacks_it(make_app, stream_names):
    async def go(js: Any) -> None:
        await js.add_stream(StreamConfig(name=stream_names.stream, subjects=["elsewhere-x.>"]))

    stream_names.run(go)
    app = _nats_app(make_app, stream_names)
    lines = _ok(_cli(app, "declare"))
    assert lines[0].endswith(f"(elsewhere-x.>, {stream_names.prefix}.>): updated")
    assert stream_names.info(stream_names.stream).config.subjects == [
        "elsewhere-x.>",
        f"{stream_names.prefix}.>",
    ]


def test_a_dead_letter_subject_the_sources_own_stream_takes_is_refused(make_app, stream_names):
    # The filter leaves it out, so the config allows it; but the stream, made
    # wider by its owner, would keep the copies and no dead-letter stream could.
    async def go(js: Any) -> None:
        await js.add_stream(StreamConfig(name=stream_names.stream, subjects=["wrm-pay.>"]))

    stream_names.run(go)
    app = _nats_app(
        make_app,
        stream_names,
        filter_subject="wrm-pay.paid",
        dead_letter_subject="wrm-pay.dead",
    )
    error = _one_line_error(_cli(app, "declare"))
    assert error == (
        f"Error: source {SOURCE}: dead_letter_subject 'wrm-pay.dead' is taken by stream "
        f"{stream_names.stream!r} (wrm-pay.>), the source's own: choose a subject outside it"
    )
    # Nothing was changed or made.
    assert stream_names.info(stream_names.stream).config.subjects == ["wrm-pay.>"]
    assert stream_names.info(stream_names.dead_stream) is None


def test_a_new_stream_without_a_filter_takes_its_name_and_refuses_it_as_dead_letters(
    make_app, stream_names
):
    app = _nats_app(
        make_app, stream_names, filter_subject=None, dead_letter_subject=stream_names.stream
    )
    assert "is taken by stream" in _one_line_error(_cli(app, "declare"))
    assert stream_names.info(stream_names.stream) is None


def test_a_dead_letter_subject_inside_the_filter_stops_the_app_at_load(make_app, stream_names):
    from webhook_receiver.config import ConfigError

    with pytest.raises(ConfigError, match="is inside filter_subject"):
        _nats_app(make_app, stream_names, dead_letter_subject=f"{stream_names.prefix}.dead")


def test_nats_publish_then_consume_stores_the_key_and_type(make_app, stream_names):
    app = _nats_app(make_app, stream_names)
    _ok(_cli(app, "declare"))
    subject = f"{stream_names.prefix}.paid"
    lines = _ok(_cli(app, "publish", SOURCE, "--key", "pay-7", "--type", subject, '{"p": 7}'))
    assert lines == [
        f"{SOURCE}: published to {subject} (stream {stream_names.stream!r}, sequence 1): "
        "Nats-Msg-Id 'pay-7'"
    ]
    again = _ok(_cli(app, "publish", SOURCE, "--key", "pay-7", "--type", subject, '{"p": 7}'))
    assert "dropped it as a duplicate" in again[0]
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
    assert _stored(app) == [("pay-7", subject, "application/json", b'{"p": 7}')]


def test_nats_publish_with_a_header_type_uses_a_literal_filter_or_subject(make_app, stream_names):
    subject = f"{stream_names.prefix}.paid"
    app = _nats_app(make_app, stream_names, filter_subject=subject, event_type="header:X-Type")
    _ok(_cli(app, "declare"))
    lines = _ok(_cli(app, "publish", SOURCE, "--key", "k-1", "--type", "paid", "body"))
    assert lines[0].startswith(f"{SOURCE}: published to {subject} ")
    assert lines[0].endswith("Nats-Msg-Id 'k-1', X-Type 'paid'")
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
    assert _stored(app) == [("k-1", "paid", None, b"body")]


def test_nats_publish_needs_a_subject_the_source_consumes(make_app, stream_names):
    app = _nats_app(make_app, stream_names)
    _ok(_cli(app, "declare"))
    result = _cli(app, "publish", SOURCE, "--key", "k", "{}")
    assert f"give --type: a subject that {stream_names.prefix}.> takes" in _one_line_error(
        result, exit_code=2
    )
    result = _cli(app, "publish", SOURCE, "--key", "k", "--type", "other.subject", "{}")
    error = _one_line_error(result, exit_code=2)
    assert f"subject 'other.subject' is outside {stream_names.prefix}.>" in error
    result = _cli(app, "publish", SOURCE, "--key", "k", "--type", f"{stream_names.prefix}.*", "{}")
    assert "no wildcards" in _one_line_error(result, exit_code=2)


def test_body_and_options_are_published_as_given(make_app, stream_names):
    # A body that is not JSON carries no content type unless one is given.
    app = _nats_app(make_app, stream_names)
    _ok(_cli(app, "declare"))
    subject = f"{stream_names.prefix}.x"
    _ok(_cli(app, "publish", SOURCE, "--key", "k", "--type", subject, "not json"))

    async def go(js: Any) -> Any:
        return await js.get_msg(stream_names.stream, 1)

    message = stream_names.run(go)
    assert (message.data, dict(message.headers)) == (b"not json", {"Nats-Msg-Id": "k"})
