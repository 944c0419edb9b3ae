"""CPU time per message over a broker run: the consumer's process, the database's, the broker's.

On two cores the three share the machine, so a rate is bounded by their sum:
these columns say where a message's CPU goes (``/proc``, Linux only). The
consumer's figure is this process's (every thread's, the client library's
C threads included; SQLite's work too); the database's counts every
PostgreSQL process on this machine, the broker's every process of its
server's name (none for moto, a Python process like others).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from .run import processes_cpu

# The process name of each broker's server, as the tests and benches start it.
SERVER_PROCESSES = {
    "rabbitmq": "beam.smp",
    "nats": "nats-server",
    "redis": "redis-server",
    "mqtt": "mosquitto",
    "pubsub": "java",
    "kafka": "tansu",
}


class Cpu(NamedTuple):
    """CPU seconds of one run: the consumer, the database server, the broker (None: unknown)."""

    consumer: float
    database: float
    broker: float | None

    def per_message(self, n: int) -> Cpu:
        """The same in microseconds per message, for ``n`` messages."""
        scale = 1e6 / n
        return Cpu(
            self.consumer * scale,
            self.database * scale,
            None if self.broker is None else self.broker * scale,
        )


# Each metered run's CPU, in the order the runs ran.
RUNS: list[Cpu] = []


@contextmanager
def metered(broker: str) -> Iterator[None]:
    """Add the block's CPU (consumer, database, broker) to RUNS."""
    before = _now(broker)
    yield
    after = _now(broker)
    RUNS.append(
        Cpu(
            after.consumer - before.consumer,
            after.database - before.database,
            None if after.broker is None or before.broker is None else after.broker - before.broker,
        )
    )


def _now(broker: str) -> Cpu:
    name = SERVER_PROCESSES.get(broker)
    return Cpu(
        time.process_time(), processes_cpu("postgres"), processes_cpu(name) if name else None
    )
