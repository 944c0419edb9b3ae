"""Processing: per-consumer deliveries of stored events (the inbox and the outbox).

Handlers are declared with :func:`handler` in modules named by the config's
``handlers`` list; forwards with ``[[sources.<name>.forward]]``. The outbox
(:mod:`.outbox`) writes their deliveries with each new event; the worker
(:mod:`.worker`, ``flask --app wsgi worker``) runs them.
"""

from __future__ import annotations

from flask import Flask

from .handlers import PermanentFailure, handler

__all__ = ["PermanentFailure", "handler", "init_app"]


def init_app(app: Flask) -> None:
    """Build the app's consumer registry and register the ``worker`` command."""
    from . import registry
    from .cli import worker_command

    registry.init_app(app)
    app.cli.add_command(worker_command)
