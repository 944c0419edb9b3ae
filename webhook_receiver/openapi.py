"""The OpenAPI 3.1 document of the HTTP surface, served at ``/openapi.json``.

Built from the same tables the code answers from (the problem types and
their descriptions), so the document cannot list a refusal the receiver
does not make. tests/test_openapi.py validates real responses against it;
fuzzers (schemathesis) read it to know what to send.
"""

from __future__ import annotations

import functools
from typing import Any

from flask import Blueprint, Flask, Response, jsonify

from .problem_pages import DESCRIPTIONS
from .problems import PROBLEM_JSON, PROBLEM_TYPES

VERSION = "0.1.0"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _problems(*statuses: int, extra: str = "", challenge: bool = False) -> dict[str, Any]:
    """Responses for these error statuses, each naming the problem types it may carry.

    ``challenge``: the operation's 401 names its scheme in WWW-Authenticate.
    """
    responses = {}
    for status in statuses:
        slugs = [slug for slug, (code, _) in PROBLEM_TYPES.items() if code == status]
        kinds = ", ".join(f"[{slug}](/problems/{slug})" for slug in slugs)
        response: dict[str, Any] = {
            "description": f"Problem details: {kinds}.{extra if status == 503 else ''}",
            "content": {PROBLEM_JSON: {"schema": _ref("Problem")}},
        }
        if status in (409, 503):
            response["headers"] = {"Retry-After": {"$ref": "#/components/headers/RetryAfter"}}
        if status == 401 and challenge:
            response["headers"] = {"WWW-Authenticate": {"$ref": "#/components/headers/Challenge"}}
        responses[str(status)] = response
    return responses


_REPLAYED = {
    "description": "`true` when this is the saved answer of an earlier request or delivery.",
    "schema": {"type": "string", "enum": ["true"]},
}
# The key as keys.parse_key takes it: bare (no comma, which a repeated
# header is joined with; no space around it, which HTTP strips), or quoted.
_KEY = {
    "type": "string",
    "anyOf": [
        {"maxLength": 255, "pattern": r"^[!#-+\--~]([ -+\--~]*[!-+\--~])?$"},
        {"pattern": r'^"([ !#-\[\]-~]|\\["\\]){1,255}"$'},
    ],
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _paths() -> dict[str, Any]:
    event_id = {
        "name": "id",
        "in": "path",
        "required": True,
        "schema": {"type": "integer", "minimum": 1},
    }
    return {
        "/api/events": {
            "post": {
                "operationId": "createEvent",
                "summary": "Store an event, exactly once per Idempotency-Key",
                "description": (
                    "The first request with a key stores the event and answers 201; a retry "
                    "with the same key and the same request gets the saved answer again, with "
                    "`Idempotent-Replayed: true`. The same key with another request is 422."
                ),
                "tags": ["API"],
                "security": [{"bearer": []}],
                "parameters": [
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "required": True,
                        "description": (
                            "Your id of this logical request: the same on every retry (a UUID "
                            "serves). 1-255 printable ASCII characters, sent bare or quoted as "
                            'the draft\'s sf-string (`"..."`, with `\\"` and `\\\\` escapes), '
                            "which a key holding a comma must be. Scoped to your client. A key "
                            "is kept for 24 hours (the default of "
                            "WEBHOOK_RECEIVER_IDEMPOTENCY_TTL_SECONDS); after that it counts "
                            "as unused and runs afresh."
                        ),
                        "schema": _KEY,
                    }
                ],
                "requestBody": {"required": True, "content": _json(_ref("NewEvent"))},
                "responses": {
                    "201": {
                        "description": "Stored (or the saved answer of the first request).",
                        "headers": {
                            "Location": {
                                "description": "The event's URL.",
                                "required": True,
                                "schema": {"type": "string"},
                            },
                            "Idempotent-Replayed": _REPLAYED,
                        },
                        "content": _json(_ref("Event")),
                    },
                    **_problems(400, 401, 409, 413, 415, 422, 503, challenge=True),
                },
            }
        },
        "/api/events/{id}": {
            "get": {
                "operationId": "getEvent",
                "summary": "Read an event back (only the client that created it)",
                "tags": ["API"],
                "security": [{"bearer": []}],
                "parameters": [event_id],
                "responses": {
                    "200": {"description": "The event.", "content": _json(_ref("Event"))},
                    **_problems(401, 404, 503, challenge=True),
                },
            }
        },
        "/webhooks/{source}": {
            "post": {
                "operationId": "receiveWebhook",
                "summary": "Receive a provider's delivery: verify, deduplicate, store",
                "description": (
                    "The signature is checked over the raw body against the source's secrets "
                    "before anything is stored. A redelivery (same dedup key, same content) "
                    "gets the first answer again with `Idempotent-Replayed: true`; the same "
                    "key with other content is 422 and kept for review."
                ),
                "tags": ["Webhooks"],
                "parameters": [
                    {
                        "name": "source",
                        "in": "path",
                        "required": True,
                        "description": "A `[sources.<name>]` table of the configuration.",
                        "schema": {"type": "string"},
                    }
                ],
                "requestBody": {
                    "required": True,
                    "description": "The provider's body, byte for byte as it was signed.",
                    "content": {
                        "application/json": {"schema": {}},
                        "application/x-www-form-urlencoded": {"schema": {"type": "object"}},
                        # Any bytes (OpenAPI 3.1: a schema that constrains nothing).
                        "*/*": {"schema": {}},
                    },
                },
                "responses": {
                    "200": {
                        "description": (
                            "Stored (or a redelivery of a stored event); for Slack's "
                            "url_verification, the challenge."
                        ),
                        "headers": {
                            "Idempotent-Replayed": _REPLAYED,
                        },
                        "content": _json(
                            {
                                "oneOf": [
                                    _ref("WebhookAccepted"),
                                    _ref("WebhookBatchAccepted"),
                                    _ref("SlackChallenge"),
                                    _ref("SlackIgnored"),
                                ]
                            }
                        ),
                    },
                    **_problems(400, 401, 404, 413, 415, 422, 503),
                },
            },
            "options": {
                "operationId": "validateWebhook",
                "summary": "The CloudEvents webhook validation handshake",
                "description": (
                    "For a `cloudevents` source, a `WebHook-Request-Origin` is answered with "
                    "`WebHook-Allowed-Origin` and `WebHook-Allowed-Rate: *`. Any other OPTIONS "
                    "gets the methods in `Allow`."
                ),
                "tags": ["Webhooks"],
                "parameters": [
                    {
                        "name": "source",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                    },
                    {
                        "name": "WebHook-Request-Origin",
                        "in": "header",
                        "required": False,
                        "schema": {"type": "string"},
                    },
                ],
                "responses": {
                    "200": {
                        "description": "The handshake's answer, or the allowed methods.",
                        "headers": {
                            "Allow": {"required": True, "schema": {"type": "string"}},
                            "WebHook-Allowed-Origin": {"schema": {"type": "string"}},
                            "WebHook-Allowed-Rate": {"schema": {"type": "string"}},
                        },
                    },
                    **_problems(400),
                },
            },
        },
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Liveness: 200 while the process runs",
                "tags": ["Probes"],
                "responses": {
                    "200": {
                        "description": "Alive.",
                        "content": _json(
                            {
                                "type": "object",
                                "required": ["status"],
                                "properties": {"status": {"const": "ok"}},
                            }
                        ),
                    }
                },
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Readiness: the database answers, at the code's migration head",
                "tags": ["Probes"],
                "responses": {
                    "200": {
                        "description": "Ready to take traffic.",
                        "content": _json(
                            {
                                "type": "object",
                                "required": ["status", "schema"],
                                "properties": {
                                    "status": {"const": "ready"},
                                    "schema": {
                                        "type": "string",
                                        "description": "The migration revision.",
                                    },
                                },
                            }
                        ),
                    },
                    **_problems(503),
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics (text format, or OpenMetrics when asked)",
                "tags": ["Probes"],
                "security": [{}, {"bearer": []}],
                "responses": {
                    "200": {
                        "description": "The counters and histograms of every process.",
                        "content": {
                            "text/plain": {"schema": {"type": "string"}},
                            "application/openmetrics-text": {"schema": {"type": "string"}},
                        },
                    },
                    **_problems(401, challenge=True),
                },
            }
        },
        "/problems": {
            "get": {
                "operationId": "listProblemTypes",
                "summary": "Every problem type, with its description",
                "tags": ["Documentation"],
                "responses": {
                    "200": {
                        "description": "The problem types (an HTML page for browsers).",
                        "content": {
                            **_json({"type": "array", "items": _ref("ProblemType")}),
                            "text/html": {"schema": {"type": "string"}},
                        },
                    }
                },
            }
        },
        "/problems/{slug}": {
            "get": {
                "operationId": "describeProblemType",
                "summary": "What a problem type means and what to do about it",
                "tags": ["Documentation"],
                "parameters": [
                    {
                        "name": "slug",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                    }
                ],
                "responses": {
                    "200": {
                        "description": "The description (an HTML page for browsers).",
                        "content": {
                            **_json(_ref("ProblemType")),
                            "text/html": {"schema": {"type": "string"}},
                        },
                    },
                    **_problems(404),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "tags": ["Documentation"],
                "responses": {
                    "200": {"description": "OpenAPI 3.1.", "content": _json({"type": "object"})}
                },
            }
        },
    }


def _schemas() -> dict[str, Any]:
    slugs = list(PROBLEM_TYPES)
    return {
        "NewEvent": {
            "type": "object",
            "required": ["type", "data"],
            "properties": {
                # No NUL: no database stores one in text (inbox/messages.py).
                "type": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 255,
                    "pattern": "^[^\\u0000]*$",
                },
                "data": {"description": "Any JSON value."},
            },
        },
        "Event": {
            "type": "object",
            "required": ["id", "type", "source", "data", "received_at", "duplicate_count"],
            "properties": {
                "id": {"type": "integer"},
                "type": {"type": ["string", "null"]},
                "source": {"type": "string", "description": "`api:<client>`"},
                "data": {"description": "The data posted."},
                "received_at": {"type": "string", "format": "date-time"},
                "duplicate_count": {"type": "integer", "minimum": 0},
            },
        },
        "WebhookAccepted": {
            "type": "object",
            "required": ["status", "event_id"],
            "properties": {
                "status": {"const": "accepted"},
                "event_id": {"type": "integer"},
            },
            "additionalProperties": False,
        },
        "WebhookBatchAccepted": {
            "type": "object",
            "description": "A CloudEvents batch: each entry's event, in the batch's order.",
            "required": ["status", "events"],
            "properties": {
                "status": {"const": "accepted"},
                "events": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["event_id", "status"],
                        "properties": {
                            "event_id": {"type": "integer"},
                            "status": {"enum": ["accepted", "duplicate"]},
                        },
                        "additionalProperties": False,
                    },
                },
            },
            "additionalProperties": False,
        },
        "SlackIgnored": {
            "type": "object",
            "description": "A Slack callback that is no event (app_rate_limited, ...): not stored.",
            "required": ["status", "type"],
            "properties": {"status": {"const": "ignored"}, "type": {"type": "string"}},
            "additionalProperties": False,
        },
        "SlackChallenge": {
            "type": "object",
            "required": ["challenge"],
            "properties": {"challenge": {"type": "string"}},
            "additionalProperties": False,
        },
        "Problem": {
            "type": "object",
            "description": "RFC 9457 problem details.",
            "required": ["type", "title", "status"],
            "properties": {
                "type": {
                    "type": "string",
                    "enum": [f"/problems/{slug}" for slug in slugs],
                    "description": "\n".join(
                        f"- `/problems/{slug}` ({PROBLEM_TYPES[slug][0]}): {DESCRIPTIONS[slug]}"
                        for slug in slugs
                    ),
                },
                "title": {"type": "string"},
                "status": {"type": "integer"},
                "detail": {"type": "string"},
                "event_id": {
                    "type": ["integer", "null"],
                    "description": (
                        "`dedup-key-conflict` only: the event stored earlier under the key, "
                        "whose content this delivery differs from."
                    ),
                },
            },
        },
        "ProblemType": {
            "type": "object",
            "required": ["type", "title", "status", "description"],
            "properties": {
                "type": {"type": "string"},
                "title": {"type": "string"},
                "status": {"type": "integer"},
                "description": {"type": "string"},
            },
        },
    }


def _with_request_id(paths: dict[str, Any]) -> dict[str, Any]:
    """Add X-Request-Id to every response: correlation.py echoes it on each, refusals too."""
    for operations in paths.values():
        for operation in operations.values():
            for response in operation["responses"].values():
                response.setdefault("headers", {})["X-Request-Id"] = {
                    "$ref": "#/components/headers/RequestId"
                }
    return paths


@functools.cache
def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document, built once per process."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "webhook-receiver",
            "version": VERSION,
            "summary": "Idempotent webhook receiver and Idempotency-Key API",
            "description": (
                "Providers and clients deliver at least once; each logical message takes "
                "effect once. Every refusal is `application/problem+json` with a `type` "
                "described at `/problems/<slug>`. A database that cannot be reached is 503 "
                "with Retry-After, never a 2xx."
            ),
            "license": {"name": "MIT", "identifier": "MIT"},
        },
        "tags": [
            {"name": "API", "description": "Events posted by clients with a bearer token."},
            {"name": "Webhooks", "description": "Provider deliveries, signed per source."},
            {"name": "Probes", "description": "Liveness, readiness and metrics."},
            {"name": "Documentation", "description": "This document and the problem types."},
        ],
        "paths": _with_request_id(_paths()),
        "components": {
            "schemas": _schemas(),
            "headers": {
                "RetryAfter": {
                    "description": "Seconds to wait before sending the request again.",
                    "required": True,
                    "schema": {"type": "string", "pattern": "^[0-9]+$"},
                },
                "RequestId": {
                    "description": (
                        "The caller's X-Request-Id when it is 1-200 characters of "
                        "`A-Za-z0-9._:@/+=-` (any other value is dropped), else the trace id "
                        "of its traceparent, or a new id."
                    ),
                    "required": True,
                    "schema": {"type": "string"},
                },
                "Challenge": {
                    "description": 'The scheme to authenticate with: `Bearer realm="..."`.',
                    "required": True,
                    "schema": {"type": "string"},
                },
            },
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A `[clients.<name>]` token (or the metrics token).",
                }
            },
        },
    }


bp = Blueprint("openapi", __name__)


@bp.get("/openapi.json")
def openapi_json() -> Response:
    """Serve the OpenAPI document."""
    return jsonify(document())


def init_app(app: Flask) -> None:
    """Serve ``/openapi.json``."""
    app.register_blueprint(bp)
