"""Fixtures: a real worker, downstream and consumer (metrics), and the JSON log on a buffer."""

from __future__ import annotations

import io
import logging

import pytest

from webhook_receiver.observability import logging as obs_logging

from ..brokers.conftest import amqp_queue, rabbit_url  # noqa: F401  (fixtures)
from ..processing.conftest import clock, downstream, make_worker  # noqa: F401  (fixtures)


@pytest.fixture
def captured():
    """Install the JSON handler on a buffer; put the package logger back afterwards."""
    logger = logging.getLogger(obs_logging.PACKAGE_LOGGER)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    buffer = io.StringIO()
    obs_logging.configure("json", "INFO", stream=buffer)
    yield buffer
    logger.handlers[:], logger.level, logger.propagate = saved
