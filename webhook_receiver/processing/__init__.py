"""Processing: per-consumer deliveries of stored events (the outbox's consumers).

Handlers are declared with :func:`handler` in modules named by the config's
``handlers`` list; forwards with ``[[sources.<name>.forward]]``. The inbox
writes their deliveries with each new event (routed by :func:`routes`); the worker
(:mod:`.worker`, ``flask --app wsgi worker``) runs them.
"""

from __future__ import annotations

from collections.abc import Callable

from flask import Flask

from . import registry
from .handlers import PermanentFailure, handler

__all__ = ["PermanentFailure", "handler", "init_app", "routes"]


def init_app(app: Flask) -> None:
    """Build the app's consumer registry."""
    registry.init_app(app)


def routes(app: Flask) -> Callable[[str, str | None, bytes], list[tuple[str, str]]]:
    """Name the (consumer, kind) of each delivery a new event gets, by its source, type and body.

    A consumer's ``filter`` is evaluated over the body (its JSON) only for
    the consumers that have one.
    """
    return registry.get(app).route
