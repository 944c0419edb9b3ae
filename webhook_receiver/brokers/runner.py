"""Running broker consumers, one thread per source, until SIGTERM.

SIGTERM or SIGINT sets a stop flag: each consumer commits and settles the
batch it has in hand, then returns. One source's failure never stops
another: a consumer waits and retries through a missing queue or stream
(logged once), and one that fails for any other reason (a bug) is logged
with its traceback and started again after a back-off, while the other
sources go on.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any, Protocol

from flask import Flask

from ..config import BrokerSourceConfig, ConfigError, FileConfig
from .jetstream import JetStreamConsumer
from .kafka import KafkaConsumer
from .mqtt import MqttConsumer
from .outage import Outage
from .pubsub import PubSubConsumer
from .rabbitmq import RabbitConsumer
from .redis_streams import RedisStreamConsumer
from .sqs import SqsConsumer

log = logging.getLogger("webhook_receiver.brokers")

# A consumer that failed after running this long backs off from the start again.
HEALTHY_SECONDS = 60.0
# How long a thread may hold the GIL while another waits for it (Python's
# default: 5 ms). A consumer's storing thread lets go of the GIL for each
# database round trip, and back with the answer it waited for the reading
# thread's Python to reach that switch: with 0.5 ms, Kafka batches of 500
# stored on PostgreSQL went from 19,100-19,500 to 22,000-22,600 records/s.
SWITCH_INTERVAL_SECONDS = 0.0005
# The cyclic garbage collector's first threshold while consuming (Python's
# default: 700 new objects). A batch of 500 makes some 15,000 objects that
# reference counting frees with it: at 700 the collector ran about twenty
# times a batch, and the batch in hand, alive across those runs, was moved
# on to the old generation, whose full collections walked every object of
# the app too. Those are frozen out of the collector at the start (they live
# as long as the process); with both, Kafka batches of 500 stored on
# PostgreSQL went from 21,200-26,600 to 28,600-31,800 records/s.
GC_FIRST_THRESHOLD = 20_000


class Consumer(Protocol):
    def run(self) -> None: ...


def sources_to_consume(file_config: FileConfig, names: Sequence[str]) -> list[BrokerSourceConfig]:
    """The broker sources named (all of them when none is), or ConfigError."""
    if not file_config.brokers:
        raise ConfigError(f"{file_config.path}: no broker source (provider {', '.join(ADAPTERS)})")
    if not names:
        return list(file_config.brokers.values())
    unknown = [n for n in names if n not in file_config.brokers]
    if unknown:
        raise ConfigError(
            f"{file_config.path}: no broker source named {', '.join(map(repr, unknown))} "
            f"(broker sources: {', '.join(sorted(file_config.brokers))})"
        )
    return [file_config.brokers[n] for n in dict.fromkeys(names)]


# One adapter per broker, by the provider name its sources give (docs/brokers.md,
# "Adding a broker").
ADAPTERS: dict[
    str,
    type[
        RabbitConsumer
        | JetStreamConsumer
        | KafkaConsumer
        | RedisStreamConsumer
        | MqttConsumer
        | SqsConsumer
        | PubSubConsumer
    ],
] = {
    "rabbitmq": RabbitConsumer,
    "nats": JetStreamConsumer,
    "kafka": KafkaConsumer,
    "redis": RedisStreamConsumer,
    "mqtt": MqttConsumer,
    "sqs": SqsConsumer,
    "pubsub": PubSubConsumer,
}


def consumer_for(app: Flask, source: BrokerSourceConfig, stop: threading.Event) -> Consumer:
    """The consumer of one broker source."""
    return ADAPTERS[source.provider](app, source, stop)


def run(app: Flask, sources: Sequence[BrokerSourceConfig], stop: threading.Event) -> None:
    """Consume ``sources`` until ``stop`` is set (SIGTERM sets it)."""
    with consuming():
        _run(app, sources, stop)


@contextmanager
def consuming() -> Iterator[None]:
    """Run the block as a consume process runs: the GIL's and the collector's settings above.

    The GIL switch interval is SWITCH_INTERVAL_SECONDS; the objects alive
    now (the app, its config, the modules) are frozen out of the cyclic
    collector, whose first threshold is GC_FIRST_THRESHOLD. The process gets
    its own settings back after the block.
    """
    switch = sys.getswitchinterval()
    thresholds = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_FIRST_THRESHOLD, *thresholds[1:])
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    try:
        yield
    finally:
        sys.setswitchinterval(switch)
        gc.set_threshold(*thresholds)
        if not frozen_before:  # else frozen by the process itself, and left so
            gc.unfreeze()


def _run(app: Flask, sources: Sequence[BrokerSourceConfig], stop: threading.Event) -> None:
    previous = _install_signals(stop)
    threads = [
        threading.Thread(target=_supervise, args=(app, source, stop), name=f"consume-{source.name}")
        for source in sources
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            # A timeout, so that the main thread keeps taking signals.
            while thread.is_alive():
                thread.join(0.2)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if previous:
            faulthandler.unregister(signal.SIGUSR1)


def _supervise(app: Flask, source: BrokerSourceConfig, stop: threading.Event) -> None:
    """Run one source's consumer until ``stop``; start it again, backing off, when it fails."""
    failures = Outage(source.name, "consumer", first=1.0)
    while not stop.is_set():
        started = time.monotonic()
        try:
            consumer_for(app, source, stop).run()
        except Exception as exc:
            if time.monotonic() - started > HEALTHY_SECONDS:
                failures.recovered()  # a failure long after the last: back off from the start
            # A bug, not an outage (those are handled inside): this source
            # starts again, the others never notice.
            log.exception("source %s: the consumer failed", source.name)
            stop.wait(failures.failed(f"{type(exc).__name__}: {exc}"))


def _install_signals(stop: threading.Event) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("consume: signal %s, finishing the current batches", signum)
        stop.set()

    # An operator's (and a test's) look at a consumer that seems stuck: every
    # thread's stack on stderr, the process going on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
