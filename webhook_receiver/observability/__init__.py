"""Observability: Prometheus metrics at ``/metrics`` and structured (JSON) logs."""

from __future__ import annotations

from flask import Flask

from . import logging, metrics

__all__ = ["init_app", "logging", "metrics"]


def init_app(app: Flask) -> None:
    """Set up this app's logs and metrics."""
    logging.init_app(app)
    metrics.init_app(app)
