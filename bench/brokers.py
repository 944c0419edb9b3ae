"""Broker scenarios: how fast ``flask consume`` stores and acknowledges, beside a bare loop.

Each scenario preloads messages on the real broker, then runs the consumer
in this process until every message is settled, and reports messages per
second. The *bare* loop is the same consumer (same connection, prefetch or
fetch, acks) with a unit of work that stores nothing: what the broker and
the client library cost on this machine. ``vs bare`` is the ratio.

Each case runs in rounds (``--rounds``, 3 by default), each round with its
own bare loop, run before and after the stored runs (its rate is from the
mean of the two times); a row gives the median rate, the range over
the rounds, and the median of the rounds' ratios. On a machine whose CPU is
shared, a single run's ratio says more about the minute than the code.

    .venv/bin/python -m bench.brokers                    # both brokers, both databases
    .venv/bin/python -m bench.brokers --broker rabbitmq --db postgresql --count 20000
    .venv/bin/python -m bench.brokers --curve            # batch sizes 1, 10, 100, 500

A measurement, not a test: nothing fails on a slow run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import nats
import pika
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from . import cpu as cpu_meter
from .broker_rounds import Round, fresh_name, key
from .cpu import Cpu
from .run import RESULTS, postgresql_database

RABBIT_URL = os.environ.get("BENCH_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
NATS_URL = os.environ.get("BENCH_NATS_URL", "nats://127.0.0.1:4222")
SOURCE = "bench"


@dataclass
class Row:
    """One scenario at one batch size: medians over its rounds."""

    broker: str
    db: str
    scenario: str
    batch: int
    count: int
    # Messages per second, one per round.
    rates: list[float]
    # The same round's rate over its bare loop's (none for the bare loop).
    ratios: list[float] | None = None
    # What the ratios are over, when not the bare loop (Kafka's stored runs: its floor).
    versus: str = ""
    # CPU microseconds per message, one per round (bench/cpu.py).
    cpu: list[Cpu] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    @property
    def ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    def cpu_median(self, part: str) -> float | None:
        """The median over the rounds of one part's CPU µs per message (consumer, database...)."""
        values = [getattr(c, part) for c in self.cpu if getattr(c, part) is not None]
        return statistics.median(values) if values else None


def _body(key: str, n: int) -> bytes:
    return json.dumps(
        {"id": key, "type": "order.paid", "data": {"order": n, "x": "y" * 64}}
    ).encode()


# -- RabbitMQ -------------------------------------------------------------------


class RabbitQueue:
    def __init__(self) -> None:
        self.name = fresh_name()
        with self.channel() as ch:
            ch.queue_declare(self.name)

    @contextmanager
    def channel(self) -> Iterator[Any]:
        connection = pika.BlockingConnection(pika.URLParameters(RABBIT_URL))
        try:
            yield connection.channel()
        finally:
            connection.close()

    def fill(self, count: int) -> None:
        with self.channel() as ch:
            ch.confirm_delivery()
            for n in range(count):
                message_id = key(self.name, n)
                props = pika.BasicProperties(
                    message_id=message_id, type="order.paid", content_type="application/json"
                )
                ch.basic_publish("", self.name, _body(message_id, n), props)

    def delete(self) -> None:
        with self.channel() as ch:
            ch.queue_delete(self.name)


# -- NATS -------------------------------------------------------------------------


class NatsStream:
    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.name = f"WRBENCH_{tag}"
        self.subject = f"wrbench-{tag}.orders"
        self.count = 0

        async def go(nc: Any) -> None:
            await nc.jetstream().add_stream(StreamConfig(name=self.name, subjects=[self.subject]))

        _nats(go)

    def fill(self, count: int) -> None:
        async def go(nc: Any) -> None:
            js = nc.jetstream()
            for start in range(0, count, 500):
                await asyncio.gather(
                    *(
                        js.publish(
                            self.subject,
                            _body(key(self.name, n), n),
                            headers={
                                "Nats-Msg-Id": key(self.name, n),
                                "Content-Type": "application/json",
                            },
                        )
                        for n in range(start, min(start + 500, count))
                    )
                )

        _nats(go)
        self.count = count

    def consumer(self, durable: str, batch: int) -> None:
        async def go(nc: Any) -> None:
            config = ConsumerConfig(
                durable_name=durable,
                ack_policy=AckPolicy.EXPLICIT,
                max_ack_pending=max(1000, 4 * batch),
            )
            await nc.jetstream().add_consumer(self.name, config)

        _nats(go)

    def delete(self) -> None:
        async def go(nc: Any) -> None:
            await nc.jetstream().delete_stream(self.name)

        _nats(go)


def _nats(fn: Callable[[Any], Any]) -> Any:
    async def main() -> Any:
        nc = await nats.connect(NATS_URL)
        try:
            return await fn(nc)
        finally:
            await nc.close()

    return asyncio.run(main())


# -- one run ------------------------------------------------------------------------


def _bare_prepare(source: Any, raws: list[Any], to_delivery: Any) -> Any:
    from webhook_receiver.brokers.batch import ACK, Prepared, Verdict

    # Read as the consumer reads them, nothing identified: every message is an ack.
    return Prepared([], [Verdict(ACK) for _ in map(to_delivery, raws)])


def _bare_store(source: Any, prepared: Any, **_positions: Any) -> list[Any]:
    return list(prepared.verdicts)


def consume(app: Any, count: int, *, bare: bool, timeout: float = 600) -> float:
    """Run the source's consumer until ``count`` messages are settled; the seconds it took."""
    from webhook_receiver.brokers import runner

    stop = threading.Event()
    consumer = runner.consumer_for(app, app.config["FILE_CONFIG"].brokers[SOURCE], stop)
    if bare:
        consumer.prepare = _bare_prepare  # type: ignore[attr-defined]
        consumer.store = _bare_store  # type: ignore[attr-defined]
    thread = threading.Thread(target=consumer.run)
    # As ``flask consume`` runs its consumers (runner.run).
    provider = app.config["FILE_CONFIG"].brokers[SOURCE].provider
    with runner.consuming(), cpu_meter.metered(provider):
        started = time.perf_counter()
        thread.start()
        deadline = started + timeout
        while consumer.settled < count and time.perf_counter() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.002)
        elapsed = time.perf_counter() - started
        stop.set()
        thread.join(30)
    if consumer.settled < count:  # type: ignore[attr-defined]
        raise RuntimeError(f"only {consumer.settled} of {count} settled in {timeout} s")  # type: ignore[attr-defined]
    return elapsed


APPS: list[Any] = []
# Where the apps' log lines go, once main() has opened it.
LOG_FILE: list[IO[str]] = []


def close_apps() -> None:
    """Write the apps' pending redeliveries and close their pools (before a database is dropped)."""
    from webhook_receiver.extensions import db
    from webhook_receiver.inbox import duplicates

    for app in APPS:
        app.extensions[duplicates.EXTENSION].close()
        with app.app_context():
            db.engine.dispose()
    APPS.clear()


def make_app(db_url: str, table: dict[str, Any]) -> Any:
    from flask_migrate import upgrade

    from webhook_receiver import create_app
    from webhook_receiver.observability.logging import configure as configure_logs

    app = create_app(
        {
            "SQLALCHEMY_DATABASE_URI": db_url,
            "SECRET_KEY": secrets.token_hex(32),
            "RECEIVER_CONFIG": {"sources": {SOURCE: table}},
        }
    )
    with app.app_context():
        upgrade()
    if LOG_FILE:
        # After the migrations, whose logging set-up replaces the root's.
        configure_logs("json", "INFO", LOG_FILE[0])
    APPS.append(app)
    return app


def run_broker(
    broker: str, db: str, db_url: str, count: int, batches: list[int], rounds: int
) -> list[Row]:
    rows: list[Row] = []
    if broker == "kafka":
        return _run_kafka(db, db_url, count, batches, rounds)
    for size in batches:
        n = count if size >= 10 else max(500, count // 20)
        rates: dict[str, list[float]] = {"bare": [], "unique": [], "redeliveries": []}
        cpus: dict[str, list[Cpu]] = {name: [] for name in rates}
        for _ in range(rounds):
            # Each round its own bare loop, around the runs it is compared with.
            bare, unique, again = _round(broker, db_url, n, size)
            rates["bare"].append(n / bare)
            rates["unique"].append(n / unique)
            rates["redeliveries"].append(n / again)
            before, stored, redelivered, after = (c.per_message(n) for c in cpu_meter.RUNS[-4:])
            cpus["bare"].append(before.mean(after))
            cpus["unique"].append(stored)
            cpus["redeliveries"].append(redelivered)
        for scenario, measured in rates.items():
            ratios = None
            if scenario != "bare":
                ratios = [rate / base for rate, base in zip(measured, rates["bare"], strict=True)]
            rows.append(Row(broker, db, scenario, size, n, measured, ratios, cpu=cpus[scenario]))
        print(*map(_line, rows[-3:]), sep="\n", flush=True)
    return rows


def _run_kafka(db: str, db_url: str, count: int, batches: list[int], rounds: int) -> list[Row]:
    """Kafka's rows: the two bare loops, then the stored runs over the storing one (floor)."""
    from .brokers_kafka import kafka_times

    rows: list[Row] = []
    for size in batches:
        n = count if size >= 10 else max(500, count // 20)
        rates: dict[str, list[float]] = {"bare": [], "floor": [], "unique": [], "redeliveries": []}
        cpus: dict[str, list[Cpu]] = {name: [] for name in rates}
        for _ in range(rounds):
            rnd = Round(db_url, n, size, make_app, consume, _body)
            times = kafka_times(rnd, (_bare_prepare, _bare_store))
            rates["bare"].append(n / ((times["bare"] + times["bare-after"]) / 2))
            rates["floor"].append(n / times["floor"])
            rates["unique"].append(n / times["unique"])
            rates["redeliveries"].append(n / times["again"])
            # In kafka_times' order (brokers_kafka.RUNS).
            before, floor, stored, redelivered, after = (
                c.per_message(n) for c in cpu_meter.RUNS[-5:]
            )
            cpus["bare"].append(before.mean(after))
            cpus["floor"].append(floor)
            cpus["unique"].append(stored)
            cpus["redeliveries"].append(redelivered)
        for scenario, measured in rates.items():
            base = {"floor": "bare", "unique": "floor", "redeliveries": "floor"}.get(scenario)
            ratios = None
            if base is not None:
                ratios = [rate / b for rate, b in zip(measured, rates[base], strict=True)]
            versus = "floor" if base == "floor" else ""
            rows.append(
                Row("kafka", db, scenario, size, n, measured, ratios, versus, cpus[scenario])
            )
        print(*map(_line, rows[-4:]), sep="\n", flush=True)
    return rows


def _round(broker: str, db_url: str, n: int, size: int) -> tuple[float, float, float]:
    """Seconds for the bare loop, n unique messages, and the same n again (redeliveries).

    The bare loop runs before and after the two (its time is their mean),
    so that a machine that speeds up or slows down during the round moves
    the baseline with the runs it is compared with.
    """
    rnd = Round(db_url, n, size, make_app, consume, _body)
    if broker in ("redis", "mqtt"):
        from .brokers_streams import mqtt_times, redis_times

        times = (redis_times if broker == "redis" else mqtt_times)(rnd)
    elif broker in ("sqs", "pubsub"):
        from .brokers_cloud import pubsub_times, sqs_times

        times = (sqs_times if broker == "sqs" else pubsub_times)(rnd)
    elif broker == "rabbitmq":
        queue = RabbitQueue()
        try:
            table = {
                "provider": "rabbitmq",
                "url": RABBIT_URL,
                "queue": queue.name,
                "prefetch": size,
            }
            app = make_app(db_url, table)
            times = []
            for is_bare in (True, False, False, True):
                # The second stored run gets the same messages: every one a redelivery.
                queue.fill(n)
                times.append(consume(app, n, bare=is_bare))
        finally:
            queue.delete()
    else:
        stream = NatsStream()

        def source_for(durable: str) -> dict[str, Any]:
            stream.consumer(durable, size)
            return {"provider": "nats", "url": NATS_URL, "stream": stream.name, "durable": durable}

        try:
            stream.fill(n)
            times = rnd.timed(source_for)
        finally:
            stream.delete()
    before, unique, again, after = times
    return (before + after) / 2, unique, again


def _line(row: Row) -> str:
    ratio = f"{row.ratio:.2f}" if row.ratio is not None else ""
    if ratio and row.versus:
        ratio += f" (vs {row.versus})"
    spread = f"{min(row.rates):,.0f}-{max(row.rates):,.0f}"
    cpu = [row.cpu_median(part) for part in Cpu._fields]
    return (
        f"| {row.broker} | {row.db} | {row.scenario} | {row.batch} | {row.count} | "
        f"{row.rate:,.0f} | {spread} | {ratio} | "
        + " | ".join("" if value is None else f"{value:.1f}" for value in cpu)
        + " |"
    )


HEADER = [
    "| broker | database | scenario | batch | messages | messages/s | range | vs bare "
    "| consumer CPU µs/msg | database CPU µs/msg | broker CPU µs/msg |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
]


@contextmanager
def database(db: str, workdir: Path) -> Iterator[str]:
    if db == "sqlite":
        yield f"sqlite:///{workdir / f'brokers-{uuid.uuid4().hex[:6]}.sqlite3'}"
        return
    server = os.environ.get("BENCH_DATABASE_URL") or os.environ.get("TEST_DATABASE_URL")
    if not server:
        raise SystemExit("PostgreSQL needs BENCH_DATABASE_URL or TEST_DATABASE_URL")
    with postgresql_database(server) as url:
        from webhook_receiver.config import database_uri

        yield database_uri(url, "/nonexistent")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.brokers", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--broker",
        choices=["rabbitmq", "nats", "redis", "mqtt", "sqs", "pubsub", "kafka", "both"],
        default="both",
    )
    parser.add_argument("--db", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--count", type=int, default=20000, help="messages per run")
    parser.add_argument("--batch", type=int, default=200, help="prefetch / fetch batch size")
    parser.add_argument("--curve", action="store_true", help="batch sizes 1, 10, 100 and 500")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of each case, each with its own bare loop"
    )
    args = parser.parse_args(argv)
    brokers = ["rabbitmq", "nats"] if args.broker == "both" else [args.broker]
    dbs = ["sqlite", "postgresql"] if args.db == "both" else [args.db]
    batches = [1, 10, 100, 500] if args.curve else [args.batch]
    if args.curve and "kafka" in brokers:
        batches.append(2000)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.getLogger("pika").setLevel(logging.ERROR)
    rows: list[Row] = []
    print(*HEADER, sep="\n", flush=True)
    # Measured as a consumer runs by default: INFO, the app's JSON lines (a
    # batch's lines name its messages), here into a file beside the table.
    with (
        tempfile.TemporaryDirectory(dir=RESULTS) as tmp,
        open(RESULTS / f"brokers-{stamp}.log", "w") as log_file,
    ):
        LOG_FILE.append(log_file)
        for db in dbs:
            for broker in brokers:
                with ExitStack() as stack:
                    url = stack.enter_context(database(db, Path(tmp)))
                    stack.callback(close_apps)
                    rows += run_broker(broker, db, url, args.count, batches, max(1, args.rounds))
    out = RESULTS / f"brokers-{stamp}.md"
    out.write_text("\n".join([*HEADER, *map(_line, rows)]) + "\n")
    print(f"written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
