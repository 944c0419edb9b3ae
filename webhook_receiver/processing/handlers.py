"""Python handlers: ``@handler(source=..., event_type=..., name=...)``.

The decorator only marks the function; nothing is registered at import.
Each app collects the handlers of the modules named by the config's
``handlers = [...]`` list (see :mod:`.registry`), so the web process, which
writes the delivery rows, and the worker, which runs them, agree on the
consumers without any global state.

A handler is called as ``func(event, session)`` inside the transaction that
also marks its delivery done: its writes and the done-marker commit together
or not at all. It must not commit or roll back the session itself. Raising
retries the delivery later with backoff (so does a statement of its own
cancelled by the statement or lock timeout, or its transaction left idle
past PostgreSQL's idle_in_transaction_session_timeout); raising
:class:`PermanentFailure` makes it dead at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..config import CONSUMER_NAME, ConfigError
from ..config.filters import Filter, parse_filter

ATTRIBUTE = "__webhook_handlers__"

HandlerFunc = Callable[[Any, Any], None]


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
        spec = HandlerSpec(
            source=source,
            event_type=event_type,
            name=name or func.__name__,
            func=func,
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
