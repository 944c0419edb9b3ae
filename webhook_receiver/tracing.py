"""Traces (OpenTelemetry): off unless configured through the standard ``OTEL_*`` variables.

With ``OTEL_TRACES_EXPORTER=otlp`` or an ``OTEL_EXPORTER_OTLP_*ENDPOINT``
set (and ``OTEL_SDK_DISABLED`` not true), each process exports its spans over
OTLP/HTTP, batched: the HTTP intakes' server spans (this module's request
hooks, which take an incoming ``traceparent``), the inbox's commits, the
broker batches, each delivery attempt and each forward. Off, every helper
here is a no-op that costs a dictionary lookup.

An event keeps the ``traceparent`` of its receipt (``Message.build``'s
``traceparent``, in its meta): the receipt's span when tracing is on, else
the one the sender sent; beside it, the sender's ``tracestate`` (W3C's
vendor data, e.g. a vendor tracer's sampling decision), only with a valid
traceparent. The worker's attempt continues that trace under that trace
state, and a forward carries both onward (its own span's, or the stored
one's trace with a new parent id and the stored tracestate as it came).

What a span costs shaped this module: the server span is three request
hooks setting the HTTP semantic conventions' main attributes, not Flask's
instrumentation, which collects and converts a request's attributes twice
and feeds metrics nobody reads (about 150 µs of CPU a request, three times
these hooks, and a heavier span to encode); ``span`` makes its span current
itself rather than through ``use_span``'s extra context manager; the
exporter is the OTLP/HTTP one with its encoding done in place (the same
bytes for a quarter of the CPU, see ``encode_spans``); and the batch
processor exports every 256 spans (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``
overrides), not 512, so fewer finished spans wait in its queue long enough
to reach the garbage collector's oldest generation and set off its full
collections.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import secrets
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any

from flask import Flask, Response, current_app, has_app_context, request
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from werkzeug.datastructures import Headers

EXTENSION = "webhook_receiver.tracing"
# Where an event keeps its receipt's traceparent: a key of its meta.
META_KEY = "traceparent"
# Where it keeps the receipt's tracestate, beside the traceparent.
TRACESTATE_META = "tracestate"
# W3C Trace Context's tracestate: at most 32 list-members, key=value, in at
# most 512 characters; the list is dropped whole if any member is not one.
TRACESTATE_LENGTH = 512
TRACESTATE_MEMBERS = 32
_TRACESTATE_MEMBER = re.compile(
    r"([a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
# W3C Trace Context: version-traceid-parentid-flags, lower-case hex only (as
# the SDK's propagator reads it), between the blanks HTTP allows; a later
# version may add fields after a dash, version 00 none.
TRACEPARENT = re.compile(
    r"[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^ \t]*)?[ \t]*"
)
_PROPAGATOR = TraceContextTextMapPropagator()
# Not traced: probes and scrapes, many a minute, about nothing received.
_EXCLUDED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Where a request keeps its server span and the context token to detach.
_ENVIRON_KEY = "webhook_receiver.tracing.server_span"
# Spans an export sends at most (the SDK's default is 512): see the module's doc.
EXPORT_BATCH_SIZE = 256
_LOGGER = logging.getLogger(__name__)


def valid_traceparent(value: str | None) -> str | None:
    """``value`` as a version-00 traceparent if W3C calls it valid, else None.

    A real trace and parent id; version ff is invalid, version 00 has four
    fields only, and a later version is read for its first four (the W3C
    rules the SDK's propagator follows: an event's stored trace is the same
    whether tracing is on or off).
    """
    if not value:
        return None
    match = TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, parent_id, flags, more = match.groups()
    if version == "ff" or (version == "00" and more) or trace_id == "0" * 32:
        return None
    if parent_id == "0" * 16:
        return None
    return f"00-{trace_id}-{parent_id}-{flags}"


def valid_tracestate(value: str | None) -> str | None:
    """``value`` as a W3C tracestate if valid (members comma-joined, blanks left out), else None.

    Past 512 characters as received (repeated headers combined), past 32
    members, a member that is not key=value, or a key twice: dropped whole,
    never truncated (a vendor's member cut off would be misread). The blanks
    and empty members W3C allows are left out, as the SDK's propagator
    writes a list: the stored value is the same whether tracing is on or off.
    """
    if not value or len(value) > TRACESTATE_LENGTH:
        return None
    members: list[str] = []
    keys: set[str] = set()
    for member in value.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        match = _TRACESTATE_MEMBER.fullmatch(member)
        if match is None or match[1] in keys:
            return None
        keys.add(match[1])
        members.append(member)
    if not members or len(members) > TRACESTATE_MEMBERS:
        return None
    return ",".join(members)


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
    # First of the before_request functions: a request refused by an earlier
    # one (problems.py's check of a chunked body) has its span too.
    app.before_request_funcs.setdefault(None, []).insert(0, _start_server_span)
    app.after_request(_server_span_status)
    app.teardown_request(_end_server_span)


def otlp_provider(endpoint: str | None = None) -> Any:
    """The production provider: OTLP/HTTP, batched, to ``endpoint`` or the OTEL_* variables'."""
    # Imported only when traces are on: the SDK and its exporter are not
    # loaded by a process that does not trace.
    from opentelemetry.sdk.environment_variables import OTEL_BSP_MAX_EXPORT_BATCH_SIZE
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override the name.
    provider = TracerProvider(resource=Resource.create({"service.name": "webhook-receiver"}))
    # The OTEL_BSP_* variables still set the batching; only the batch size
    # has a default of this module's when its variable is not set.
    batch = None if os.environ.get(OTEL_BSP_MAX_EXPORT_BATCH_SIZE) else EXPORT_BATCH_SIZE
    processor = BatchSpanProcessor(_exporter(endpoint), max_export_batch_size=batch)
    provider.add_span_processor(processor)
    return provider


def _exporter(endpoint: str | None) -> Any:
    """The OTLP/HTTP span exporter, whose encoding builds each request in place."""
    return _in_place_exporter_class()(endpoint=endpoint)


@functools.cache
def _in_place_exporter_class() -> type:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    class InPlaceOTLPSpanExporter(OTLPSpanExporter):  # type: ignore[misc]
        """``OTLPSpanExporter``, sending the same bytes for less CPU.

        The exporter's encoder builds each span, attribute and value as a
        message of its own, then copies it into its parent, three levels
        deep, about 25 µs a span; ``encode_spans`` below fills one request
        in place, about 6 µs. The rest (endpoint, headers, compression,
        retries, the size limit, the exporter's own metrics) is the
        exporter's, through the attributes its ``export`` uses: a version
        that has changed them gets its own ``export`` back, unchanged.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            needed = ("_shutdown", "_metrics", "_client", "_max_request_size")
            self._in_place = all(hasattr(self, name) for name in needed)

        def export(self, spans: Any) -> Any:
            if not self._in_place or self._shutdown:
                return super().export(spans)
            with self._metrics.export_operation(len(spans)) as result:
                try:
                    data = encode_spans(spans)
                except Exception as error:  # the exporter's own handling of a bad batch
                    _LOGGER.error("Failed to encode span batch: %s", error)
                    result.error = error
                    return SpanExportResult.FAILURE
                if 0 < self._max_request_size < len(data):
                    _LOGGER.warning("Dropping span batch: %d bytes exceeds the limit", len(data))
                    result.error = ValueError(f"span batch of {len(data)} bytes")
                    return SpanExportResult.FAILURE
                sent = self._client.export(data)
                if not sent.success:
                    result.error = sent.error
                    return SpanExportResult.FAILURE
            return SpanExportResult.SUCCESS

    return InPlaceOTLPSpanExporter


def encode_spans(spans: Sequence[Any]) -> bytes:
    """The serialized OTLP ``ExportTraceServiceRequest`` of finished SDK spans.

    The same message as the OTLP exporters' ``encode_spans`` (a test holds
    them equal), filled in place: one request, a resource's and a scope's
    spans grouped by the objects the spans share.
    """
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    by_resource: dict[int, Any] = {}
    by_scope: dict[tuple[int, int], Any] = {}
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope
        key = (id(resource), id(scope))
        out = by_scope.get(key)
        if out is None:
            resource_spans = by_resource.get(id(resource))
            if resource_spans is None:
                resource_spans = by_resource[id(resource)] = request.resource_spans.add()
                resource_spans.resource.SetInParent()
                _set_attributes(resource_spans.resource.attributes, resource.attributes)
                if resource.schema_url:
                    resource_spans.schema_url = resource.schema_url
            scope_spans = resource_spans.scope_spans.add()
            scope_spans.scope.SetInParent()
            if scope is not None:
                if scope.name:
                    scope_spans.scope.name = scope.name
                if scope.version:
                    scope_spans.scope.version = scope.version
                _set_attributes(scope_spans.scope.attributes, scope.attributes)
                if scope.schema_url:
                    scope_spans.schema_url = scope.schema_url
            out = by_scope[key] = scope_spans.spans
        _encode_span(out.add(), span)
    return request.SerializePartialToString()


# OTLP's span kinds are the API's, counted from 1 (0 is "unspecified").
_KINDS = {kind: kind.value + 1 for kind in trace.SpanKind}
# The OTLP span flags: the parent's "is remote" is known, and whether it is.
_FLAG_HAS_IS_REMOTE = 0x100
_FLAG_IS_REMOTE = 0x200


def _span_flags(parent: Any) -> int:
    if parent and parent.is_remote:
        return _FLAG_HAS_IS_REMOTE | _FLAG_IS_REMOTE
    return _FLAG_HAS_IS_REMOTE


def _encode_span(out: Any, span: Any) -> None:
    context = span.context
    out.trace_id = context.trace_id.to_bytes(16, "big")
    out.span_id = context.span_id.to_bytes(8, "big")
    if context.trace_state:
        out.trace_state = ",".join(f"{key}={value}" for key, value in context.trace_state.items())
    parent = span.parent
    if parent:
        out.parent_span_id = parent.span_id.to_bytes(8, "big")
    try:
        out.name = span.name
    except ValueError:  # see _text
        out.name = _text(span.name)
    out.kind = _KINDS[span.kind]
    out.start_time_unix_nano = span.start_time
    out.end_time_unix_nano = span.end_time
    _set_attributes(out.attributes, span.attributes)
    for event in span.events:
        encoded = out.events.add()
        try:
            encoded.name = event.name
        except ValueError:
            encoded.name = _text(event.name)
        encoded.time_unix_nano = event.timestamp
        _set_attributes(encoded.attributes, event.attributes)
        encoded.dropped_attributes_count = event.dropped_attributes
    for link in span.links:
        encoded = out.links.add()
        encoded.trace_id = link.context.trace_id.to_bytes(16, "big")
        encoded.span_id = link.context.span_id.to_bytes(8, "big")
        _set_attributes(encoded.attributes, link.attributes)
        encoded.dropped_attributes_count = link.dropped_attributes
        encoded.flags = _span_flags(link.context)
    status = span.status
    out.status.SetInParent()
    if status.status_code is not trace.StatusCode.UNSET:
        out.status.code = status.status_code.value
    if status.description:
        try:
            out.status.message = status.description
        except ValueError:  # an exception's text, which may quote what a client sent
            out.status.message = _text(status.description)
    # Zero is proto3's default: not set, not sent.
    if span.dropped_attributes:
        out.dropped_attributes_count = span.dropped_attributes
    if span.dropped_events:
        out.dropped_events_count = span.dropped_events
    if span.dropped_links:
        out.dropped_links_count = span.dropped_links
    out.flags = _span_flags(parent)


def _set_attributes(out: Any, attributes: Mapping[str, Any] | None) -> None:
    if not attributes:
        return
    for key, value in attributes.items():
        pair = out.add()
        try:
            pair.key = key
            _set_value(pair.value, value)
        # Left out, as the exporter's encoder does: a type OTLP has not, a
        # lone surrogate (no UTF-8) or an integer past 64 bits (ValueErrors
        # of protobuf's). Raised, it would cost the whole batch.
        except (TypeError, ValueError) as error:
            del out[-1]
            _LOGGER.error("Failed to encode key %r: %s", key, error)


def _set_value(out: Any, value: Any) -> None:
    out.SetInParent()
    if value is None:
        return
    if isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, int):
        out.int_value = value
    elif isinstance(value, float):
        out.double_value = value
    elif isinstance(value, bytes):
        out.bytes_value = value
    elif isinstance(value, Sequence):
        values = out.array_value.values
        out.array_value.SetInParent()
        for item in value:
            _set_value(values.add(), item)
    elif isinstance(value, Mapping):
        pairs = out.kvlist_value.values
        out.kvlist_value.SetInParent()
        for key, item in value.items():
            pair = pairs.add()
            pair.key = str(key)
            _set_value(pair.value, item)
    else:
        raise TypeError(f"Invalid type {type(value)} of value {value}")


_SURROGATES = re.compile("[\ud800-\udfff]")


def _text(value: str) -> str:
    """``value`` with each lone surrogate replaced by U+FFFD: a string protobuf can hold.

    Where the exporter's encoder would fail the whole batch (a span's or an
    event's name, a status message), one character is replaced instead.
    """
    return _SURROGATES.sub("\ufffd", value)


class _HeaderGetter(Getter[Any]):
    """Reads a propagator's header from a request's headers (case-insensitive)."""

    def get(self, carrier: Any, key: str) -> list[str] | None:
        value = carrier.get(key)
        return None if value is None else [value]

    def keys(self, carrier: Any) -> list[str]:
        return [name for name, _ in carrier.items()]


_HEADERS = _HeaderGetter()
# HTTP's semantic conventions: the methods a span is named by (RFC 9110, PATCH).
_KNOWN_METHODS = frozenset(
    {"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE"}
)


def _start_server_span() -> None:
    # The request's span: a SERVER span continuing the sender's traceparent
    # (the configured propagators, W3C by default), or a child of the span
    # an embedding server already opened. Named and attributed after the
    # HTTP semantic conventions, read once from the request itself rather
    # than through Flask's proxy, an indirection per read.
    tracer = _tracer()
    if tracer is None:
        return
    current = request._get_current_object()  # type: ignore[attr-defined]
    path = current.path
    if path in _EXCLUDED_PATHS:
        return
    environ = current.environ
    method = current.method
    attributes: dict[str, Any] = {"url.scheme": current.scheme, "url.path": path}
    if method in _KNOWN_METHODS:
        attributes["http.request.method"] = name = method
    else:
        # Any token a client sends would name a span of its own (back ends
        # index span names): the conventions' "_OTHER", the token kept aside.
        attributes["http.request.method"] = "_OTHER"
        attributes["http.request.method_original"] = method
        name = "HTTP"
    rule = current.url_rule
    if rule is not None:
        attributes["http.route"] = rule.rule
        name = f"{name} {rule.rule}"
    address = environ.get("REMOTE_ADDR")
    if address:
        attributes["client.address"] = address
    agent = environ.get("HTTP_USER_AGENT")
    if agent:
        attributes["user_agent.original"] = agent
    if trace.get_current_span() is trace.INVALID_SPAN:
        parent: Context | None = propagate.extract(current.headers, getter=_HEADERS)
        kind = trace.SpanKind.SERVER
    else:
        parent, kind = None, trace.SpanKind.INTERNAL
    opened = tracer.start_span(name, context=parent, kind=kind, attributes=attributes)
    token = otel_context.attach(trace.set_span_in_context(opened, parent))
    environ[_ENVIRON_KEY] = (opened, token)


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
    tracestate: str | None = None,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    **attributes: Any,
) -> Iterator[trace.Span | None]:
    """A span named ``name`` around the block (None when tracing is off).

    ``parent``: a stored traceparent the span continues (a delivery attempt
    continues its event's receipt), ``tracestate`` its stored trace state;
    by default the current span's child. Attributes whose value is None are
    left out.
    """
    tracer = _tracer()
    if tracer is None:
        yield None
        return
    context = _context_of(parent, tracestate) if parent else None
    values = {key: value for key, value in attributes.items() if value is not None}
    opened = tracer.start_span(name, context=context, kind=kind, attributes=values)
    # What trace.use_span(end_on_exit=True) does, without its own layer of
    # context manager: the span is current for the block, records an error
    # that escapes it (an Exception, not a GeneratorExit), and ends.
    token = otel_context.attach(trace.set_span_in_context(opened))
    try:
        yield opened
    except Exception as exc:
        opened.record_exception(exc)
        opened.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        otel_context.detach(token)
        opened.end()


def end_with(opened: trace.Span, ok: bool, status: int | None, error: str | None) -> None:
    """Record an attempt's or a forward's outcome on its span (an error status if it failed)."""
    if status is not None:
        opened.set_attribute("http.response.status_code", status)
    if not ok:
        opened.set_status(trace.Status(trace.StatusCode.ERROR, error))


def _context_of(traceparent: str, tracestate: str | None = None) -> Context:
    if tracestate:
        return _PROPAGATOR.extract({"traceparent": traceparent, "tracestate": tracestate})
    return _PROPAGATOR.extract({"traceparent": traceparent})


def current_trace(headers: Headers) -> tuple[str | None, str | None]:
    """The traceparent and tracestate an event received with ``headers`` keeps.

    The current span's (the server span, continuing the sender's) when
    tracing is on, else the sender's: its valid traceparent, and its
    tracestate only beside one (Message.build checks the tracestate; a
    request without a traceparent has its tracestate header left unread).
    """
    if on():
        current = trace.get_current_span().get_span_context()
        if current.is_valid:
            # What the W3C propagator's inject writes, without its carrier.
            state = current.trace_state
            return (
                f"00-{current.trace_id:032x}-{current.span_id:016x}-{current.trace_flags:02x}",
                state.to_header() if state else None,
            )
    sent = valid_traceparent(headers.get("traceparent"))
    if sent is None:
        return None, None
    return sent, headers.get("tracestate")


def outgoing(
    headers: MutableMapping[str, str],
    stored: str | None,
    correlation_id: str,
    tracestate: str | None = None,
) -> None:
    """Set the ``traceparent`` (and ``tracestate``) a forward sends: its span's, else the stored.

    Without tracing, the stored traceparent's trace goes on under a new
    parent id, with the stored ``tracestate`` as it came (a participant
    that does not trace passes it on unchanged); an event stored without
    one whose correlation id is a trace id (a sender's traceparent, before
    traces were kept) goes on under that, with no tracestate.
    """
    if on():
        # The span's trace state is the attempt's, which is the stored one.
        _PROPAGATOR.inject(headers)
        if "traceparent" in headers:
            return
    trace_id, flags = None, "01"
    stored = valid_traceparent(stored)
    if stored is not None:
        # Not tracing, the receiver decides no sampling: the sender's flags go on.
        _, trace_id, _, flags = stored.split("-")
        if tracestate:
            headers["tracestate"] = tracestate
    elif re.fullmatch(r"[0-9a-f]{32}", correlation_id) and correlation_id != "0" * 32:
        trace_id = correlation_id
    if trace_id is not None:
        headers["traceparent"] = f"00-{trace_id}-{secrets.token_hex(8)}-{flags}"


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


def tracestate_in(headers: Mapping[str, Any]) -> str | None:
    """A broker message's ``tracestate`` header as text (Message.build checks it), or None.

    By its exact, lower-case name too; read only for a message whose
    ``traceparent_in`` is valid (W3C: a tracestate means nothing without one).
    """
    value = headers.get("tracestate")
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    return value if isinstance(value, str) else None
