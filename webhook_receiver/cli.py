"""The app's ``flask`` commands end a known failure with one line naming the fix.

A configuration error, a database that cannot be reached, or one without
its schema says so and how to fix it; a traceback is kept for the bugs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click
from flask import Flask
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, ProgrammingError

from .config import ConfigError

# SQLite says "no such table"; PostgreSQL raises UndefinedTable ('relation "x" does
# not exist'), not to be confused with a database that does not exist.
_NO_SCHEMA = ("no such table", "undefinedtable", 'relation "')


def _cause(exc: DBAPIError) -> str:
    return str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__


def is_missing_schema(exc: BaseException) -> bool:
    """Tell whether a database error says a table is missing: the migrations never ran."""
    return isinstance(exc, OperationalError | ProgrammingError) and any(
        marker in f"{type(exc.orig).__name__} {_cause(exc)}".lower() for marker in _NO_SCHEMA
    )


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


def init_app(app: Flask) -> None:
    """Give each of the app's commands (registered by now) one-line errors."""
    for command in app.cli.commands.values():
        # Command objects are module-level and shared by every app made in a
        # process (tests make hundreds): wrap each once, not once per app.
        if getattr(command, _WRAPPED, False):
            continue
        command.invoke = _one_line(command.invoke)  # type: ignore[method-assign,assignment]
        setattr(command, _WRAPPED, True)
