"""``/problems/<slug>``: what each problem type means and what to do about it.

A problem's ``type`` is a link a developer follows: a browser gets a page,
anything else the same description as JSON. The OpenAPI document
(``/openapi.json``) lists them too, from the same table.
"""

from __future__ import annotations

from flask import Blueprint, Flask, Response, abort, jsonify, render_template, request

from .problems import PROBLEM_TYPES

# slug -> what it means, and what the sender should do. Every slug of
# problems.PROBLEM_TYPES has one (checked when the blueprint is registered).
DESCRIPTIONS: dict[str, str] = {
    "bad-request": "The request cannot be read as sent. Fix it before sending it again.",
    "invalid-json": (
        "The body is not strict JSON (UTF-8, no duplicate keys, no NaN or Infinity, "
        "not nested too deeply). "
        "Fix the body; retrying it unchanged fails the same way."
    ),
    "invalid-event": (
        'POST /api/events takes a JSON object {"type": "<1-255 characters>", "data": '
        "<any JSON>}. The answer's detail names what is missing or wrong."
    ),
    "idempotency-key-missing": (
        "POST /api/events needs an Idempotency-Key header: a value you choose per "
        "logical request (a UUID, or your own id of the order) and send again, "
        "unchanged, on every retry of that request."
    ),
    "idempotency-key-invalid": (
        "The Idempotency-Key must be 1-255 printable ASCII characters, sent once "
        "(optionally as a quoted structured-field string)."
    ),
    "payload-invalid": (
        "The delivery's body cannot be read as its provider sends it (not JSON, not "
        "form-encoded, or a header that carries the dedup key was sent twice). "
        "Nothing was stored."
    ),
    "dedup-key-missing": (
        "The delivery carries none of the ids this source deduplicates on (the event "
        "id, a delivery header, or the source's dedup_key setting). Nothing was stored."
    ),
    "unauthorized": (
        "Send Authorization: Bearer <token> with a token from a [clients.<name>] table "
        "of the configuration (or, for /metrics, WEBHOOK_RECEIVER_METRICS_TOKEN)."
    ),
    "signature-invalid": (
        "No configured secret of this source verifies the delivery's signature over "
        "the raw body. Check that the secret in the configuration is the one the "
        "provider shows, and that nothing between the provider and the receiver "
        "rewrites the body. The refusal is listed in the admin's Rejections."
    ),
    "timestamp-out-of-tolerance": (
        "The signed timestamp is further from the receiver's clock than the source's "
        "tolerance_seconds (300 by default), in the past or the future: a replayed old "
        "delivery, or a clock that is off. Check both clocks (NTP)."
    ),
    "forbidden": "The credentials are valid but do not allow this request; nothing was done.",
    "not-found": "Nothing is at this URL, or the event belongs to another client.",
    "unknown-source": (
        "No [sources.<name>] table of the configuration has this name. Add one (and "
        "restart), or fix the URL the provider posts to."
    ),
    "method-not-allowed": (
        "This URL does not take that method; the Allow header lists the ones it does."
    ),
    "idempotency-key-in-use": (
        "A request with this Idempotency-Key is still running. Wait for the seconds in "
        "Retry-After and send it again: you then get its saved answer."
    ),
    "idempotency-lease-lost": (
        "The request ran longer than its lease (WEBHOOK_RECEIVER_IDEMPOTENCY_LEASE_SECONDS) "
        "and another request took the key over; nothing of it was kept. Retry it."
    ),
    "payload-too-large": (
        "The body is larger than WEBHOOK_RECEIVER_MAX_BODY_BYTES (1 MiB by default). "
        "Nothing was stored."
    ),
    "unsupported-media-type": (
        "The Content-Type is missing, not one this endpoint reads, or too long."
    ),
    "idempotency-key-reused": (
        "This Idempotency-Key was already used by this client for a different request "
        "(another method, path, query or body). Nothing ran. Use a new key for a new "
        "request; the same key only for retries of the same one."
    ),
    "dedup-key-conflict": (
        "An event with this dedup key was already stored with different content: the "
        "provider sent two different messages under one id. The original is "
        "untouched; this delivery is kept for an operator to review (admin: Conflicts). "
        "Retrying it changes nothing."
    ),
    "internal-error": (
        "The receiver failed unexpectedly; nothing was committed. Retry later; the "
        "operators have the log line (look for the X-Request-Id of the answer)."
    ),
    "database-unavailable": (
        "The database cannot be reached or is busy; nothing was committed. Retry after "
        "the seconds in Retry-After: the request is safe to send again."
    ),
}


def describe(slug: str) -> dict[str, object]:
    """A problem type's document: type, title, status and description."""
    status, title = PROBLEM_TYPES[slug]
    return {
        "type": f"/problems/{slug}",
        "title": title,
        "status": status,
        "description": DESCRIPTIONS[slug],
    }


bp = Blueprint("problem_pages", __name__)


def _wants_html() -> bool:
    best = request.accept_mimetypes.best_match(["application/json", "text/html"])
    return best == "text/html"


@bp.get("/problems")
@bp.get("/problems/")
def index() -> Response | str:
    """List every problem type."""
    docs = [describe(slug) for slug in PROBLEM_TYPES]
    if _wants_html():
        return render_template("problems/index.html", problems=docs)
    return jsonify(docs)


@bp.get("/problems/<slug>")
def problem(slug: str) -> Response | str:
    """Describe one problem type: a page for browsers, JSON for the rest."""
    if slug not in PROBLEM_TYPES:
        abort(404)
    if _wants_html():
        return render_template("problems/problem.html", problem=describe(slug))
    return jsonify(describe(slug))


def init_app(app: Flask) -> None:
    """Serve the problem types' descriptions."""
    missing = set(PROBLEM_TYPES) - set(DESCRIPTIONS)
    if missing:  # pragma: no cover - a new problem type needs its description
        raise RuntimeError(f"problem types without a description: {sorted(missing)}")
    app.register_blueprint(bp)
