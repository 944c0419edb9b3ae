"""Running broker consumers, one thread per source, until SIGTERM.

SIGTERM or SIGINT sets a stop flag: each consumer commits and settles the
batch it has in hand, then returns. A consumer that cannot run as
configured (a missing queue or stream) stops them all: the process exits
non-zero with its message, for its supervisor to show.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any, Protocol

from flask import Flask

from ..config import BrokerSourceConfig, ConfigError, FileConfig
from .jetstream import JetStreamConsumer
from .outage import FatalConsumerError
from .rabbitmq import RabbitConsumer

log = logging.getLogger("webhook_receiver.brokers")


class Consumer(Protocol):
    def run(self) -> None: ...


def sources_to_consume(file_config: FileConfig, names: Sequence[str]) -> list[BrokerSourceConfig]:
    """The broker sources named (all of them when none is), or ConfigError."""
    if not file_config.brokers:
        raise ConfigError(f"{file_config.path}: no broker source (provider rabbitmq or nats)")
    if not names:
        return list(file_config.brokers.values())
    unknown = [n for n in names if n not in file_config.brokers]
    if unknown:
        raise ConfigError(
            f"{file_config.path}: no broker source named {', '.join(map(repr, unknown))} "
            f"(broker sources: {', '.join(sorted(file_config.brokers))})"
        )
    return [file_config.brokers[n] for n in dict.fromkeys(names)]


def consumer_for(app: Flask, source: BrokerSourceConfig, stop: threading.Event) -> Consumer:
    """The consumer of one broker source."""
    if source.provider == "rabbitmq":
        return RabbitConsumer(app, source, stop)
    return JetStreamConsumer(app, source, stop)


def run(app: Flask, sources: Sequence[BrokerSourceConfig], stop: threading.Event) -> str | None:
    """Consume ``sources`` until ``stop`` is set (SIGTERM sets it); the fatal error, if any."""
    previous = _install_signals(stop)
    fatal: list[str] = []

    def target(consumer: Consumer) -> None:
        try:
            consumer.run()
        except FatalConsumerError as exc:
            fatal.append(str(exc))
            stop.set()
        except Exception:
            # A bug, not an outage: the others stop too rather than run on
            # with one source silently unconsumed.
            log.exception("a broker consumer failed")
            fatal.append("a broker consumer failed (see the log)")
            stop.set()

    threads = [
        threading.Thread(
            target=target, args=(consumer_for(app, s, stop),), name=f"consume-{s.name}"
        )
        for s in sources
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
    return fatal[0] if fatal else None


def _install_signals(stop: threading.Event) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("consume: signal %s, finishing the current batches", signum)
        stop.set()

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
