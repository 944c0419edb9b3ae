"""Traces (OpenTelemetry): off unless configured through the standard ``OTEL_*`` variables.

With ``OTEL_TRACES_EXPORTER=otlp`` or an ``OTEL_EXPORTER_OTLP_*ENDPOINT``
set (and ``OTEL_SDK_DISABLED`` not true), each process exports its spans over
OTLP/HTTP, batched: the HTTP intakes' server spans (this module's request
hooks, which take an incoming ``traceparent``), the inbox's commits, the
broker batches, each delivery attempt and each forward. Off, every helper
here is a no-op that costs a dictionary lookup.

An event keeps the ``traceparent`` of its receipt (``Message.build``'s
``traceparent``, in its meta): the receipt's span when tracing is on, else
the one the sender sent. The worker's attempt continues that trace, and a
forward carries it onward (its own span's, or the stored one's trace with a
new parent id).

What a span costs shaped this module: the server span is three request
hooks setting the HTTP semantic conventions' main attributes, not Flask's
instrumentation, which collects and converts a request's attributes twice
and feeds metrics nobody reads (about 150 µs of CPU a request, three times
these hooks, and a heavier span to encode); and the batch processor exports
every 256 spans (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` overrides), not 512, so
fewer finished spans wait in its queue long enough to reach the garbage
collector's oldest generation and set off its full collections.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

from flask import Flask, Response, current_app, has_app_context, request
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

EXTENSION = "webhook_receiver.tracing"
# Where an event keeps its receipt's traceparent: a key of its meta.
META_KEY = "traceparent"
# W3C Trace Context, version 00: version-traceid-parentid-flags.
TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
_PROPAGATOR = TraceContextTextMapPropagator()
# Not traced: probes and scrapes, many a minute, about nothing received.
_EXCLUDED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Where a request keeps its server span and the context token to detach.
_ENVIRON_KEY = "webhook_receiver.tracing.server_span"
# Spans an export sends at most (the SDK's default is 512): see the module's doc.
EXPORT_BATCH_SIZE = 256


def valid_traceparent(value: str | None) -> str | None:
    """``value`` if it is a W3C traceparent with a real trace and parent id, else None."""
    if not value:
        return None
    value = value.strip().lower()
    match = TRACEPARENT.match(value)
    if match is None or match.group(1) == "0" * 32 or match.group(2) == "0" * 16:
        return None
    return value


def configured() -> bool:
    """Whether the environment asks for traces (the SDK's own variables)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return exporter == "otlp" or any(os.environ.get(name) for name in endpoints)


def init_app(app: Flask) -> None:
    """Trace this app if configured; ``OTEL_TRACER_PROVIDER`` in its config gives the provider.

    The latter is for an embedding process (and the tests, with an
    in-memory exporter): its provider is used as it is.
    """
    provider = app.config.get("OTEL_TRACER_PROVIDER")
    if provider is None and configured():
        provider = otlp_provider()
    if provider is None:
        return
    app.extensions[EXTENSION] = provider.get_tracer("webhook_receiver")
    app.before_request(_start_server_span)
    app.after_request(_server_span_status)
    app.teardown_request(_end_server_span)


def otlp_provider(endpoint: str | None = None) -> Any:
    """The production provider: OTLP/HTTP, batched, to ``endpoint`` or the OTEL_* variables'."""
    # Imported only when traces are on: the SDK and its exporter are not
    # loaded by a process that does not trace.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.environment_variables import OTEL_BSP_MAX_EXPORT_BATCH_SIZE
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override the name.
    provider = TracerProvider(resource=Resource.create({"service.name": "webhook-receiver"}))
    # The OTEL_BSP_* variables still set the batching; only the batch size
    # has a default of this module's when its variable is not set.
    batch = None if os.environ.get(OTEL_BSP_MAX_EXPORT_BATCH_SIZE) else EXPORT_BATCH_SIZE
    processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint), max_export_batch_size=batch)
    provider.add_span_processor(processor)
    return provider


class _HeaderGetter(Getter[Any]):
    """Reads a propagator's header from a request's headers (case-insensitive)."""

    def get(self, carrier: Any, key: str) -> list[str] | None:
        value = carrier.get(key)
        return None if value is None else [value]

    def keys(self, carrier: Any) -> list[str]:
        return [name for name, _ in carrier.items()]


_HEADERS = _HeaderGetter()


def _start_server_span() -> None:
    # The request's span: a SERVER span continuing the sender's traceparent
    # (the configured propagators, W3C by default), or a child of the span
    # an embedding server already opened. Named and attributed after the
    # HTTP semantic conventions.
    tracer = _tracer()
    if tracer is None or request.path in _EXCLUDED_PATHS:
        return
    method = request.method
    attributes: dict[str, Any] = {
        "http.request.method": method,
        "url.scheme": request.scheme,
        "url.path": request.path,
    }
    name = method
    rule = request.url_rule
    if rule is not None:
        attributes["http.route"] = rule.rule
        name = f"{method} {rule.rule}"
    if request.remote_addr:
        attributes["client.address"] = request.remote_addr
    agent = request.headers.get("User-Agent")
    if agent:
        attributes["user_agent.original"] = agent
    if trace.get_current_span() is trace.INVALID_SPAN:
        parent: Context | None = propagate.extract(request.headers, getter=_HEADERS)
        kind = trace.SpanKind.SERVER
    else:
        parent, kind = None, trace.SpanKind.INTERNAL
    opened = tracer.start_span(name, context=parent, kind=kind, attributes=attributes)
    token = otel_context.attach(trace.set_span_in_context(opened, parent))
    request.environ[_ENVIRON_KEY] = (opened, token)


def _server_span_status(response: Response) -> Response:
    held = request.environ.get(_ENVIRON_KEY)
    if held is not None:
        held[0].set_attribute("http.response.status_code", response.status_code)
        if response.status_code >= 500:
            held[0].set_status(trace.StatusCode.ERROR)
    return response


def _end_server_span(exc: BaseException | None) -> None:
    held = request.environ.pop(_ENVIRON_KEY, None)
    if held is None:
        return
    opened, token = held
    if exc is not None:
        opened.record_exception(exc)
        opened.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
    opened.end()
    otel_context.detach(token)


def _tracer() -> trace.Tracer | None:
    if not has_app_context():
        return None
    tracer: trace.Tracer | None = current_app.extensions.get(EXTENSION)
    return tracer


def on() -> bool:
    """Whether this app traces."""
    return _tracer() is not None


@contextmanager
def span(
    name: str,
    *,
    parent: str | None = None,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    **attributes: Any,
) -> Iterator[trace.Span | None]:
    """A span named ``name`` around the block (None when tracing is off).

    ``parent``: a stored traceparent the span continues (a delivery attempt
    continues its event's receipt); by default the current span's child.
    Attributes whose value is None are left out.
    """
    tracer = _tracer()
    if tracer is None:
        yield None
        return
    context = _context_of(parent) if parent else None
    values = {key: value for key, value in attributes.items() if value is not None}
    opened = tracer.start_span(name, context=context, kind=kind, attributes=values)
    with trace.use_span(opened, end_on_exit=True):
        yield opened


def end_with(opened: trace.Span, ok: bool, status: int | None, error: str | None) -> None:
    """Record an attempt's or a forward's outcome on its span (an error status if it failed)."""
    if status is not None:
        opened.set_attribute("http.response.status_code", status)
    if not ok:
        opened.set_status(trace.Status(trace.StatusCode.ERROR, error))


def _context_of(traceparent: str) -> Context:
    return _PROPAGATOR.extract({"traceparent": traceparent})


def current_traceparent(fallback: str | None = None) -> str | None:
    """The current span's traceparent when tracing is on, else ``fallback`` (if valid)."""
    if on():
        # What the W3C propagator's inject writes, without its carrier.
        current = trace.get_current_span().get_span_context()
        if current.is_valid:
            return f"00-{current.trace_id:032x}-{current.span_id:016x}-{current.trace_flags:02x}"
    return valid_traceparent(fallback)


def outgoing(headers: MutableMapping[str, str], stored: str | None, correlation_id: str) -> None:
    """Set the ``traceparent`` a forward sends: its span's, else the stored trace's, else none.

    Without tracing, the stored traceparent's trace goes on under a new
    parent id; an event stored without one whose correlation id is a trace
    id (a sender's traceparent, before traces were kept) goes on under that.
    """
    if on():
        _PROPAGATOR.inject(headers)
        if "traceparent" in headers:
            return
    trace_id = None
    stored = valid_traceparent(stored)
    if stored is not None:
        trace_id = stored.split("-")[1]
    elif re.fullmatch(r"[0-9a-f]{32}", correlation_id) and correlation_id != "0" * 32:
        trace_id = correlation_id
    if trace_id is not None:
        headers["traceparent"] = f"00-{trace_id}-{secrets.token_hex(8)}-01"


def traceparent_in(headers: Mapping[str, Any] | None) -> str | None:
    """A broker message's valid ``traceparent`` header, or None.

    By its exact, lower-case name, as the W3C propagators write it (a
    broker's headers are case-sensitive, and a per-message search of every
    name would cost each message of a batch).
    """
    if not headers:
        return None
    value = headers.get("traceparent")
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    return valid_traceparent(value) if isinstance(value, str) else None
