"""Traces (OpenTelemetry): off unless configured through the standard ``OTEL_*`` variables.

With ``OTEL_TRACES_EXPORTER=otlp`` or an ``OTEL_EXPORTER_OTLP_*ENDPOINT``
set (and ``OTEL_SDK_DISABLED`` not true), each process exports its spans over
OTLP/HTTP, batched: the HTTP intakes' server spans (Flask's instrumentation,
which takes an incoming ``traceparent``), the inbox's commits, the broker
batches, each delivery attempt and each forward. Off, every helper here is a
no-op that costs a dictionary lookup.

An event keeps the ``traceparent`` of its receipt (``Message.build``'s
``traceparent``, in its meta): the receipt's span when tracing is on, else
the one the sender sent. The worker's attempt continues that trace, and a
forward carries it onward (its own span's, or the stored one's trace with a
new parent id).
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

from flask import Flask, current_app, has_app_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

EXTENSION = "webhook_receiver.tracing"
# Where an event keeps its receipt's traceparent: a key of its meta.
META_KEY = "traceparent"
# W3C Trace Context, version 00: version-traceid-parentid-flags.
TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
_PROPAGATOR = TraceContextTextMapPropagator()
# Not traced: probes and scrapes, many a minute, about nothing received.
_EXCLUDED_URLS = "healthz,readyz,metrics"


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
        provider = _otlp_provider()
    if provider is None:
        return
    from opentelemetry.instrumentation.flask import FlaskInstrumentor

    FlaskInstrumentor().instrument_app(
        app, tracer_provider=provider, excluded_urls=_EXCLUDED_URLS, enable_commenter=False
    )
    app.extensions[EXTENSION] = provider.get_tracer("webhook_receiver")


def _otlp_provider() -> Any:
    # Imported only when traces are on: the SDK and its exporter are not
    # loaded by a process that does not trace.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override the name.
    provider = TracerProvider(resource=Resource.create({"service.name": "webhook-receiver"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


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
    with tracer.start_as_current_span(
        name, context=context, kind=kind, attributes=values
    ) as opened:
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
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        if "traceparent" in carrier:
            return carrier["traceparent"]
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
