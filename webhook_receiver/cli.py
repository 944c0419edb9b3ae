"""The app's ``flask`` commands end a known failure with one line naming the fix.

A configuration error, a database that cannot be reached, a wait for a
lock or a statement that ran out, or a database without its schema says
so and how to fix it; a traceback is kept for the bugs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click
from flask import Flask
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from .config import ConfigError
from .database import is_missing_schema
from .observability import metrics_server

# The database answered, and said a wait ran out: PostgreSQL's
# lock_not_available (lock_timeout) and query_canceled (statement_timeout).
_LOCK_NOT_AVAILABLE = "55P03"
_QUERY_CANCELED = "57014"


def _cause(exc: DBAPIError) -> str:
    return str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__


def explain(exc: BaseException) -> str | None:
    """The one-line message for a failure an operator can fix, or None for a bug."""
    if isinstance(exc, ConfigError):
        return str(exc)
    if isinstance(exc, DBAPIError):
        cause = _cause(exc)
        if is_missing_schema(exc):
            return (
                f"the database has no schema yet ({cause}): "
                "run `flask --app wsgi db upgrade` (make run does)"
            )
        sqlstate = getattr(exc.orig, "sqlstate", None)
        if sqlstate == _LOCK_NOT_AVAILABLE:
            return (
                f"the database is locked by another session ({cause}): another "
                "`flask db upgrade` or a long transaction holds what this command needs; "
                "run it again once that ends (or give it a longer lock_timeout)"
            )
        if sqlstate == _QUERY_CANCELED:
            return (
                f"a statement ran past its time limit ({cause}): the database is busy, "
                "or its statement_timeout is too short for this command"
            )
        if isinstance(exc, OperationalError | InterfaceError):
            return (
                f"the database cannot be reached ({cause}): "
                "is it running, and is DATABASE_URL right?"
            )
    return None


def _one_line(invoke: Callable[[click.Context], Any]) -> Callable[[click.Context], Any]:
    @functools.wraps(invoke)
    def wrapper(ctx: click.Context) -> Any:
        try:
            return invoke(ctx)
        except (ConfigError, DBAPIError) as exc:
            message = explain(exc)
            if message is None:
                raise
            raise click.ClickException(message) from exc

    return wrapper


_WRAPPED = "_webhook_receiver_one_line"
# The commands that run until SIGTERM, as processes of their own (the
# Procfile's worker and consumer): each may serve its own /metrics, unless
# given one of the flags named (a quick look, not a run).
LONG_RUNNING = {"worker": (), "consume": ("list_only",)}


def init_app(app: Flask) -> None:
    """Give each of the app's commands (registered by now) one-line errors."""
    for name, unless in LONG_RUNNING.items():
        # First, so that a metrics port that cannot be bound ends in one line too.
        if name in app.cli.commands:
            metrics_server.serve_while_running(app.cli.commands[name], unless)
    for command in app.cli.commands.values():
        # Command objects are module-level and shared by every app made in a
        # process (tests make hundreds): wrap each once, not once per app.
        if getattr(command, _WRAPPED, False):
            continue
        command.invoke = _one_line(command.invoke)  # type: ignore[method-assign,assignment]
        setattr(command, _WRAPPED, True)
