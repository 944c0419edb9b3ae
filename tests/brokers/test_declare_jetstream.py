"""``flask brokers declare`` for NATS JetStream: the streams that exist already."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import nats
import nats.js.errors
import pytest
from nats.js.api import RetentionPolicy, StreamConfig

SOURCE = "payments"


class Names:
    def __init__(self, url: str) -> None:
        tag = uuid.uuid4().hex[:10]
        self.url = url
        self.stream = f"WRDECLARE_{tag}"
        self.prefix = f"wrdeclare-{tag}"
        self.dead_stream = f"WRDECLARE_{tag}_KEPT"

    @property
    def dead_subject(self) -> str:
        return f"dead.{self.prefix}"

    def source(self) -> dict[str, Any]:
        return {
            "provider": "nats",
            "url": self.url,
            "stream": self.stream,
            "filter_subject": f"{self.prefix}.>",
            "dead_letter_subject": self.dead_subject,
        }

    def run(self, coro_fn: Any) -> Any:
        async def main() -> Any:
            nc = await nats.connect(self.url, connect_timeout=2)
            try:
                return await coro_fn(nc.jetstream())
            finally:
                await nc.close()

        return asyncio.run(main())


@pytest.fixture
def names(nats_url: str) -> Iterator[Names]:
    names = Names(nats_url)
    yield names

    async def clean(js: Any) -> None:
        for name in (names.stream, f"{names.stream}_DEAD", names.dead_stream):
            try:
                await js.delete_stream(name)
            except nats.js.errors.NotFoundError:
                pass

    names.run(clean)


def test_a_dead_letter_stream_that_keeps_nothing_without_a_consumer_is_named(make_app, names):
    # Interest retention keeps a message only for the consumers there are:
    # with none, each dead letter published to it is dropped at once.
    async def make(js: Any) -> None:
        config = StreamConfig(
            name=names.dead_stream,
            subjects=[names.dead_subject],
            retention=RetentionPolicy.INTEREST,
        )
        await js.add_stream(config)

    async def kept(js: Any) -> int:
        await js.publish(names.dead_subject, b"a dead letter")
        return (await js.stream_info(names.dead_stream)).state.messages

    names.run(make)
    assert names.run(kept) == 0  # dropped, as the consumer's copies would be
    app = make_app({"sources": {SOURCE: names.source()}})
    result = app.test_cli_runner().invoke(args=["brokers", "declare"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert errors == [
        f"Error: source {SOURCE}: stream {names.dead_stream!r}, which takes dead_letter_subject "
        f"{names.dead_subject!r}, has interest retention and no consumer: it would drop every "
        "dead letter; give it a consumer, or give the subject a stream with limits retention"
    ]

    async def made(js: Any) -> bool:
        try:
            await js.stream_info(names.stream)
        except nats.js.errors.NotFoundError:
            return False
        return True

    assert not names.run(made)  # refused before anything is made
