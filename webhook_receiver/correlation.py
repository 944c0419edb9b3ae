"""A correlation id per request: taken from the caller when it sends one, else made up.

It is returned as ``X-Request-Id``, stored on the event, logged with every
line about the request, and sent downstream when the event is forwarded.
"""

from __future__ import annotations

import re
import uuid

from flask import Flask, Response, g, request

from . import tracing

HEADER = "X-Request-Id"
_SAFE = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")


def from_request() -> str:
    """Pick the correlation id of the current request."""
    given = request.headers.get(HEADER, "").strip()
    if _SAFE.match(given):
        return given
    # Only a valid traceparent's trace: a forward carries a correlation id
    # that is a trace id onward as that trace (tracing.outgoing).
    traceparent = tracing.valid_traceparent(request.headers.get("traceparent"))
    if traceparent is not None:
        return traceparent.split("-")[1]
    return uuid.uuid4().hex


def current() -> str | None:
    """The current request's correlation id, if any."""
    return g.get("correlation_id")


def init_app(app: Flask) -> None:
    """Set ``g.correlation_id`` before each request and echo it in the response."""

    def _set() -> None:
        g.correlation_id = from_request()

    # First of the app's before_request functions, whatever was registered
    # earlier: a request refused by one of those (problems.py's check of a
    # chunked body) still gets its id, in its answer and its log lines.
    app.before_request_funcs.setdefault(None, []).insert(0, _set)

    @app.after_request
    def _echo(response: Response) -> Response:
        if "correlation_id" in g:
            response.headers[HEADER] = g.correlation_id
        return response
