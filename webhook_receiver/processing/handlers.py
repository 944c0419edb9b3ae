"""Python handlers: ``@handler(source=..., event_type=..., name=...)``.

The decorator only marks the function; nothing is registered at import.
Each app collects the handlers of the modules named by the config's
``handlers = [...]`` list (see :mod:`.registry`), so the web process, which
writes the delivery rows, and the worker, which runs them, agree on the
consumers without any global state.

A handler is called as ``func(event, session)`` inside the transaction that
also marks its delivery done: its writes and the done-marker commit together
or not at all. It must not commit or roll back the session itself: its
commit raises, and a rollback of its own fails the attempt (a savepoint,
``session.begin_nested()``, is its to commit or roll back). Raising
retries the delivery later with backoff (so does a statement of its own
cancelled by the statement or lock timeout, or its transaction left idle
past PostgreSQL's idle_in_transaction_session_timeout); raising
:class:`PermanentFailure` makes it dead at once.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event as sa_event
from sqlalchemy.orm import Session, scoped_session

from ..config import CONSUMER_NAME, ConfigError
from ..config.filters import Filter, parse_filter

ATTRIBUTE = "__webhook_handlers__"

HandlerFunc = Callable[[Any, Any], None]
# In a session's ``info`` while a handler runs on it.
_RUNNING = "webhook_receiver.handler_running"
ENDED_ITSELF = (
    "a handler must not commit or roll back the session: its writes commit with "
    "its delivery's done-marker, or not at all"
)


class PermanentFailure(Exception):
    """Raised by a handler when retrying cannot help: the delivery becomes dead."""


@dataclass(frozen=True)
class HandlerSpec:
    """One registration of a handler function."""

    source: str
    event_type: str | None  # None: every event type of the source
    name: str
    func: HandlerFunc
    max_attempts: int | None = None
    # Only events whose JSON body this finds true get a delivery (None: every event).
    filter: Filter | None = None

    def matches(self, source: str, event_type: str | None) -> bool:
        """Tell whether this handler consumes events of this source and type."""
        return self.source == source and self.event_type in (None, event_type)


@sa_event.listens_for(Session, "before_commit")
def _refuse_a_handler_s_commit(session: Session) -> None:
    # Its writes would commit without the done-marker: a failure after the
    # commit retried the delivery, writing them again. A savepoint's is its own.
    if session.info.get(_RUNNING) and not session.in_nested_transaction():
        raise RuntimeError(ENDED_ITSELF)


def _guarded(func: HandlerFunc) -> HandlerFunc:
    """``func``, refused its session's commit, and failed if it rolled the session back."""

    @functools.wraps(func)
    def run(event: Any, session: Any) -> None:
        current = session() if isinstance(session, scoped_session) else session
        transaction = current.get_transaction()
        current.info[_RUNNING] = True
        try:
            func(event, session)
        finally:
            current.info.pop(_RUNNING, None)
        if transaction is not None and current.get_transaction() is not transaction:
            # A rollback (or close) undid the delivery's lock, and its entity's
            # version on an ordered source: what follows commits without them.
            raise RuntimeError(ENDED_ITSELF)

    return run


def handler(
    *,
    source: str,
    event_type: str | None = None,
    name: str | None = None,
    max_attempts: int | None = None,
    filter: str | None = None,
) -> Callable[[HandlerFunc], HandlerFunc]:
    """Mark a function as the handler ``name`` of ``source`` events (of ``event_type``).

    ``filter`` is a JMESPath expression over the event's JSON body: only
    events it finds true get a delivery (a bad one is a ConfigError here).
    """

    if max_attempts is not None and (
        not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1
    ):
        # As a forward's: 0 would make every delivery dead before it ran.
        raise ValueError(f"handler max_attempts must be a positive integer, not {max_attempts!r}")

    def decorate(func: HandlerFunc) -> HandlerFunc:
        # Called, either returns at once with none of its body run: delivered, never done.
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise ValueError(
                f"handler {name or func.__name__!r} is a coroutine function (async def): "
                "the worker calls a handler and does not await it; make it a plain def"
            )
        if inspect.isgeneratorfunction(func):
            raise ValueError(
                f"handler {name or func.__name__!r} is a generator function: "
                "calling it runs none of its body; do not yield in a handler"
            )
        spec = HandlerSpec(
            source=source,
            event_type=event_type,
            name=name or func.__name__,
            func=_guarded(func),
            max_attempts=max_attempts,
            filter=None
            if filter is None
            else parse_filter(filter, f"handler {name or func.__name__!r}:"),
        )
        if not CONSUMER_NAME.match(spec.name):
            raise ValueError(f"handler name {spec.name!r}: use letters, digits, '.', '_', '-'")
        # Stacking decorators registers one function for several sources.
        setattr(func, ATTRIBUTE, (*getattr(func, ATTRIBUTE, ()), spec))
        return func

    return decorate


def specs_of(func: Any) -> tuple[HandlerSpec, ...]:
    """The registrations carried by a decorated function (none for anything else)."""
    specs = getattr(func, ATTRIBUTE, ())
    return specs if isinstance(specs, tuple) else ()


def load(module_names: Iterable[str]) -> list[HandlerSpec]:
    """Import the handler modules and collect their decorated functions."""
    found: list[HandlerSpec] = []
    for module_name in module_names:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise ConfigError(f"handlers: cannot import {module_name!r}: {exc}") from exc
        for value in vars(module).values():
            # Only functions defined here: an imported handler is its own module's.
            if getattr(value, "__module__", None) == module.__name__:
                found.extend(specs_of(value))
    return found
