"""Errors as RFC 9457 problem details, for the API and webhook surfaces.

Every refusal the receiver makes has its own ``type`` here, so clients can
tell the cases apart without parsing ``detail``. Each type is also served as
a description at ``/problems/<slug>`` (problem_pages.py).
"""

from __future__ import annotations

import json
from typing import Any

from flask import Flask, Response, request
from gunicorn.http.errors import ParseException
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from werkzeug.exceptions import BadRequest, HTTPException, RequestEntityTooLarge

from .database import damage_message, is_damaged, is_missing_schema, is_unavailable
from .extensions import db

# slug -> (status, title)
PROBLEM_TYPES: dict[str, tuple[int, str]] = {
    "bad-request": (400, "Bad request"),
    "invalid-json": (400, "The body is not valid JSON"),
    "invalid-event": (400, "The event is not of the expected shape"),
    "idempotency-key-missing": (400, "Idempotency-Key header is required"),
    "idempotency-key-invalid": (400, "Idempotency-Key header is malformed"),
    "payload-invalid": (400, "The delivery's payload cannot be read"),
    "dedup-key-missing": (400, "The delivery carries no stable dedup key"),
    "unauthorized": (401, "Missing or unknown bearer token"),
    "signature-invalid": (401, "The delivery's signature does not verify"),
    "timestamp-out-of-tolerance": (401, "The signed timestamp is too old or in the future"),
    "forbidden": (403, "Forbidden"),
    "not-found": (404, "Not found"),
    "unknown-source": (404, "No webhook source of that name is configured"),
    "method-not-allowed": (405, "Method not allowed"),
    "idempotency-key-in-use": (409, "A request with this Idempotency-Key is in progress"),
    "idempotency-lease-lost": (409, "The request outlived its lease and was taken over"),
    "payload-too-large": (413, "The body is larger than the configured limit"),
    "unsupported-media-type": (415, "Unsupported media type"),
    "idempotency-key-reused": (422, "Idempotency-Key reused with a different request"),
    "dedup-key-conflict": (422, "Dedup key reused with different content"),
    "internal-error": (500, "Internal server error"),
    "database-unavailable": (503, "The database cannot be reached"),
}

PROBLEM_JSON = "application/problem+json"


class Problem(Exception):
    """A refusal to be answered as problem+json."""

    def __init__(
        self,
        slug: str,
        detail: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        if slug not in PROBLEM_TYPES:
            raise ValueError(f"unknown problem type {slug!r}")
        super().__init__(detail or PROBLEM_TYPES[slug][1])
        self.slug = slug
        self.status, self.title = PROBLEM_TYPES[slug]
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra


def problem_response(problem: Problem) -> Response:
    """Render a Problem as an application/problem+json response."""
    doc: dict[str, Any] = {
        "type": f"/problems/{problem.slug}",
        "title": problem.title,
        "status": problem.status,
    }
    if problem.detail:
        doc["detail"] = problem.detail
    doc.update(problem.extra)
    response = Response(
        json.dumps(doc, separators=(",", ":")), status=problem.status, mimetype=PROBLEM_JSON
    )
    response.headers.update(problem.headers)
    return response


_HTTP_SLUGS = {
    400: "bad-request",
    401: "unauthorized",
    403: "forbidden",
    404: "not-found",
    405: "method-not-allowed",
    413: "payload-too-large",
    415: "unsupported-media-type",
    # An unhandled exception (Flask logs it first): never an HTML page on the API.
    500: "internal-error",
}

# Surfaces that speak problem+json; the admin pages speak HTML.
_JSON_PREFIXES = ("/api/", "/webhooks/", "/problems/", "/metrics", "/readyz", "/healthz")


# The machine surfaces' own paths that no prefix above covers: the document
# and the list of problem types are read by programs too.
_JSON_PATHS = frozenset({"/api", "/webhooks", "/problems", "/openapi.json"})


def _wants_problem_json() -> bool:
    return request.path.startswith(_JSON_PREFIXES) or request.path in _JSON_PATHS


def _refuse_streamed_body_over_the_limit() -> None:
    # Werkzeug refuses a Content-Length over MAX_CONTENT_LENGTH, but a body
    # sent without one (chunked) is cut at the limit without a word: the view
    # would read a truncated body, and the Idempotency-Key engine would store
    # (and replay) the answer to it. Read such a body up front, and peek one
    # byte past the limit in the server's own stream.
    limit = request.max_content_length
    if limit is None or request.content_length is not None:
        return
    try:
        if len(request.get_data(cache=True)) >= limit and request.environ["wsgi.input"].read(1):
            raise RequestEntityTooLarge()
    except (ParseException, OSError) as exc:
        # The server cannot read the chunks (a size line that is not hex, or
        # too large, a missing CRLF, the client gone): the request is
        # malformed, whatever path it was sent to.
        raise BadRequest("the chunked request body is malformed") from exc


def init_app(app: Flask) -> None:
    """Register the error handlers that turn failures into problem details."""
    app.register_error_handler(Problem, problem_response)
    app.before_request(_refuse_streamed_body_over_the_limit)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response | HTTPException:
        if not _wants_problem_json():
            return exc
        slug = _HTTP_SLUGS.get(exc.code or 500)
        if slug is None:
            return exc
        headers = {}
        if exc.code == 405 and exc.response is None:
            allow = getattr(exc, "valid_methods", None)
            if allow:
                headers["Allow"] = ", ".join(allow)
        return problem_response(Problem(slug, exc.description, headers=headers))

    @app.errorhandler(PoolTimeout)
    @app.errorhandler(DBAPIError)
    def database_error(exc: DBAPIError | PoolTimeout) -> Response:
        # A dropped connection is the database being away: say 503 so the
        # sender retries, and never claim a commit that did not happen.
        db.session.rollback()
        if is_damaged(exc):
            app.logger.error("%s", damage_message(exc))
            return problem_response(Problem("database-unavailable", headers={"Retry-After": "5"}))
        if is_unavailable(exc):
            app.logger.warning("database unavailable: %s", exc)
            return problem_response(Problem("database-unavailable", headers={"Retry-After": "5"}))
        if is_missing_schema(exc):
            # Code ahead of its migrations (a deploy in progress): nothing was
            # committed and the request will succeed once they ran, as /readyz says.
            app.logger.error("the database has no schema yet: run the migrations (%s)", exc)
            return problem_response(
                Problem(
                    "database-unavailable",
                    "the database has no schema yet",
                    headers={"Retry-After": "30"},
                )
            )
        app.logger.exception("database error")
        return problem_response(Problem("internal-error"))
