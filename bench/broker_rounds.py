"""One broker round of ``python -m bench.brokers``: what it is given, and its four runs.

A round fills the broker with ``n`` messages (keys ``<name>-evt-<i>``) and
times the runs of RUNS, each a source of its own (a consumer group, a
subscription, a session) read by ``flask consume``'s consumer until all
``n`` are settled: the bare loop, the unique messages, the same messages
again (every one a redelivery), the bare loop after.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RUNS = (("bare", True), ("unique", False), ("again", False), ("bare-after", True))


@dataclass(frozen=True)
class Round:
    """A round's database, message count and batch size, and bench.brokers' own helpers."""

    db_url: str
    n: int
    size: int
    make_app: Callable[[str, dict[str, Any]], Any]
    consume: Callable[..., float]
    body: Callable[[str, int], bytes]

    def timed(self, source_for: Callable[[str], dict[str, Any]]) -> list[float]:
        """Seconds for each of RUNS, each run's source the table ``source_for(run)`` returns.

        ``source_for`` makes what the run reads (and fills it, where each run
        is given the messages anew); the round's batch size is added to it.
        """
        times = []
        for run, is_bare in RUNS:
            table = {**source_for(run), "batch": self.size}
            times.append(self.consume(self.make_app(self.db_url, table), self.n, bare=is_bare))
        return times


def fresh_name() -> str:
    """A name of the round's own for what it makes on the broker (queue, stream, topic)."""
    return f"wr-bench-{uuid.uuid4().hex[:8]}"


def key(name: str, i: int) -> str:
    """The key of the ``i``-th message sent to ``name`` (a queue, stream or topic).

    Unique per queue or stream: the runs of a curve share one database, and
    a run's unique messages must not be duplicates of the last run's.
    """
    return f"{name}-evt-{i}"
