"""The metrics' tests run a real worker against a real downstream, and a real consumer: fixtures."""

from __future__ import annotations

from ..brokers.conftest import amqp_queue, rabbit_url  # noqa: F401  (fixtures)
from ..processing.conftest import clock, downstream, make_worker  # noqa: F401  (fixtures)
