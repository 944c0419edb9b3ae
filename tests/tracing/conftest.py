"""The traces' tests go through every intake and the worker: their fixtures, by name."""

from __future__ import annotations

from ..brokers.conftest import (  # noqa: F401  (fixtures, used by name)
    amqp_queue,
    jetstream,
    nats_url,
    rabbit_url,
)
from ..processing.conftest import clock, downstream, make_worker  # noqa: F401  (fixtures)
