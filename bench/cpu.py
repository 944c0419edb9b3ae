"""CPU time per message over a broker run: the consumer's process, the database's, the broker's.

On two cores the three share the machine, so a rate is bounded by their sum:
these columns say where a message's CPU goes (``/proc``, Linux only). The
consumer's figure is this process's (every thread's, the client library's
C threads included; SQLite's work too); the database's counts every
PostgreSQL process on this machine, the broker's every process of its
server's name (none for moto, a Python process like others).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterator
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

    def minus(self, earlier: Cpu) -> Cpu:
        """The CPU spent between ``earlier`` and this reading."""
        return _fieldwise(self, earlier, operator.sub)

    def mean(self, other: Cpu) -> Cpu:
        """The mean of two runs' CPU (a bare loop's, before and after)."""
        return _fieldwise(self, other, lambda one, two: (one + two) / 2)


def _fieldwise(one: Cpu, other: Cpu, combine: Callable[[float, float], float]) -> Cpu:
    # The broker's part is unknown if either side's is.
    broker = (
        None if one.broker is None or other.broker is None else combine(one.broker, other.broker)
    )
    return Cpu(combine(one.consumer, other.consumer), combine(one.database, other.database), broker)


# Each metered run's CPU, in the order the runs ran.
RUNS: list[Cpu] = []


@contextmanager
def metered(broker: str) -> Iterator[None]:
    """Add the block's CPU (consumer, database, broker) to RUNS."""
    before = _now(broker)
    yield
    RUNS.append(_now(broker).minus(before))


def _now(broker: str) -> Cpu:
    name = SERVER_PROCESSES.get(broker)
    return Cpu(
        time.process_time(), processes_cpu("postgres"), processes_cpu(name) if name else None
    )
