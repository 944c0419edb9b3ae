"""Who consumes which events: the forwards from the config and the handlers from code.

The registry is built once per app and kept in ``app.extensions``; the
outbox asks it which consumers an event has, the worker asks it what to do
with a claimed delivery. Consumer names are unique per source, since a
delivery row is unique on (event, consumer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flask import Flask, current_app

from ..config import ConfigError, FileConfig, ForwardConfig, OrderingConfig
from ..config.filters import Filter, document
from . import handlers as handlers_mod
from .handlers import HandlerSpec
from .outcomes import AttemptOutcome

EXTENSION = "webhook_processing"
# How many (source, event type) routes a registry keeps worked out.
_ROUTES_KEPT = 4096
HANDLER = "handler"
FORWARD = "forward"


@dataclass(frozen=True)
class Consumer:
    """One consumer of a source's events: a handler or a forward."""

    source: str
    name: str
    kind: str  # HANDLER | FORWARD
    handler: HandlerSpec | None = None
    forward: ForwardConfig | None = None

    @property
    def max_attempts(self) -> int | None:
        """The consumer's own attempt limit, if it sets one."""
        spec = self.handler or self.forward
        return spec.max_attempts if spec else None

    @property
    def concurrency(self) -> int:
        """How many of its deliveries one worker process runs at once (a forward says; else 1)."""
        return self.forward.concurrency if self.forward is not None else 1

    @property
    def filter(self) -> Filter | None:
        """The consumer's filter over the event's JSON body, if it has one."""
        spec = self.handler or self.forward
        return spec.filter if spec else None

    def matches(self, event_type: str | None) -> bool:
        """Tell whether this consumer wants events of this type."""
        if self.handler is not None:
            return self.handler.event_type in (None, event_type)
        assert self.forward is not None
        types = self.forward.event_types
        return types is None or event_type in types


@dataclass
class Registry:
    """The consumers of every source, the ordering rules, and the outcome hooks."""

    consumers: dict[str, dict[str, Consumer]] = field(default_factory=dict)
    ordering: dict[str, OrderingConfig] = field(default_factory=dict)
    # Called with each AttemptOutcome: the place for metrics to hook in.
    outcome_hooks: list[Callable[[AttemptOutcome], None]] = field(default_factory=list)
    # route()'s consumers per (source, event type): those without a filter,
    # and those with one.
    _routes: dict[tuple[str, str | None], tuple[list[tuple[str, str]], list[Consumer]]] = field(
        default_factory=dict, repr=False
    )

    def add(self, consumer: Consumer) -> None:
        """Add a consumer; a second one of the same name on a source is an error."""
        names = self.consumers.setdefault(consumer.source, {})
        if consumer.name in names:
            raise ConfigError(
                f"source {consumer.source!r} has two consumers named {consumer.name!r} "
                "(forward and handler names share one namespace per source)"
            )
        names[consumer.name] = consumer

    def for_event(self, source: str, event_type: str | None) -> list[Consumer]:
        """The consumers that get a delivery for a new event of this source and type."""
        return [c for c in self.consumers.get(source, {}).values() if c.matches(event_type)]

    def route(self, source: str, event_type: str | None, body: bytes) -> list[tuple[str, str]]:
        """The (name, kind) of each consumer that gets a delivery of a new event with this body.

        The inbox's routes, called for every new message: a consumer's type
        match is worked out once per source and type, and the body is parsed
        only when a consumer of them has a filter.
        """
        found = self._routes.get((source, event_type))
        if found is None:
            if len(self._routes) >= _ROUTES_KEPT:
                self._routes.clear()  # event types are the senders' to choose
            wanted = self.for_event(source, event_type)
            found = self._routes[(source, event_type)] = (
                [(c.name, c.kind) for c in wanted if c.filter is None],
                [c for c in wanted if c.filter is not None],
            )
        plain, filtered = found
        if not filtered:
            return plain
        value = document(body)
        return plain + [(c.name, c.kind) for c in filtered if c.filter and c.filter.passes(value)]

    def filtered_out(self, source: str, event_type: str | None, body: bytes) -> list[str]:
        """The consumers of this source and type whose filter drops this body."""
        value = document(body)
        return [
            c.name
            for c in self.for_event(source, event_type)
            if c.filter is not None and not c.filter.passes(value)
        ]

    def find(self, source: str, name: str) -> Consumer | None:
        """The consumer ``name`` of ``source``, if it is still configured."""
        return self.consumers.get(source, {}).get(name)

    def forwards(self) -> list[ForwardConfig]:
        """Every configured forward."""
        return [c.forward for cs in self.consumers.values() for c in cs.values() if c.forward]


def build(file_config: FileConfig) -> Registry:
    """Build the registry from the validated config, importing the handler modules."""
    registry = Registry(ordering=dict(file_config.ordering))
    for source, forwards in file_config.forwards.items():
        for forward in forwards:
            registry.add(Consumer(source, forward.name, FORWARD, forward=forward))
    sources = {*file_config.sources, *file_config.brokers}
    sources.update(f"api:{client}" for client in file_config.clients)
    for spec in handlers_mod.load(file_config.handlers):
        if spec.source not in sources:
            # Else it was registered and never called: no event of that source comes.
            raise ConfigError(
                f"handlers: handler {spec.name!r} of {spec.func.__module__} is for "
                f"no source {spec.source!r} (the config has {', '.join(sorted(sources))})"
            )
        registry.add(Consumer(spec.source, spec.name, HANDLER, handler=spec))
    return registry


def init_app(app: Flask) -> None:
    """Build this app's registry from its file config."""
    app.extensions[EXTENSION] = build(app.config["FILE_CONFIG"])


def get(app: Flask | None = None) -> Registry:
    """The registry of ``app`` (by default the current app)."""
    return (app or current_app).extensions[EXTENSION]
