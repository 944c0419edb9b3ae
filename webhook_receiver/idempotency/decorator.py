"""``@idempotent``: make any Flask view safe to retry under an Idempotency-Key.

The claim commits on its own, so concurrent retries see it (409) and a
crashed holder's lease can expire. The view's writes and the saved response
then commit in one transaction: a retry sees either nothing or the whole.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast
from urllib.parse import parse_qsl, urlencode

from flask import Response, current_app, g, request

from ..database import writer_turn
from ..extensions import db
from ..fingerprint import JSONError, canonical_json, fingerprint, is_json_type, loads
from ..observability import metrics
from ..problems import Problem, problem_response
from . import records
from .keys import parse_key

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# Only these response headers are replayed: the ones that describe the
# result. Cookies, credentials, hop-by-hop and per-response headers never are.
_REPLAYED_HEADERS = frozenset(
    {"content-type", "location", "etag", "link", "content-language", "last-modified"}
)
_NEVER_REPLAYED = frozenset({"x-request-id", "x-correlation-id"})


def request_fingerprint() -> str:
    """Fingerprint the current request: method, path, query and the (canonical) body."""
    body = request.get_data(cache=True)
    if is_json_type(request.content_type):
        try:
            body = canonical_json(loads(body))
        except JSONError:
            pass  # not JSON after all: the raw bytes are the content
    query = urlencode(sorted(parse_qsl(request.query_string.decode("latin-1"), True)))
    return fingerprint([request.method, request.path, query, body])


def _saved_headers(response: Response) -> list[list[str]]:
    saved = []
    for name, value in response.headers.items():
        lower = name.lower()
        if lower in _REPLAYED_HEADERS or (lower.startswith("x-") and lower not in _NEVER_REPLAYED):
            saved.append([name, value])
    return saved


def _now() -> datetime:
    return datetime.now(UTC)


def idempotent(view: F) -> F:
    """Run ``view`` at most once per (client, Idempotency-Key); replay its response after.

    Needs ``g.client`` (the authenticated client's name) set before it runs.
    The view must not commit: its writes commit together with the saved
    response, or not at all.
    """

    @functools.wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        key = parse_key(request.headers)
        assert key is not None
        req = records.Request(
            client=g.client,
            key=key,
            fingerprint=request_fingerprint(),
            method=request.method,
            path=request.path,
        )
        config = current_app.config
        lease = timedelta(seconds=int(config["IDEMPOTENCY_LEASE_SECONDS"]))
        ttl = timedelta(seconds=int(config["IDEMPOTENCY_TTL_SECONDS"]))
        outcome = records.claim(req, _now(), lease, ttl)

        if isinstance(outcome, records.Replay):
            response = Response(outcome.body, status=outcome.status)
            response.headers.clear()
            for name, value in outcome.headers:
                response.headers.add(name, value)
            response.headers["Idempotent-Replayed"] = "true"
            _log(logging.INFO, "idempotency replay", "replay", req, outcome.status)
            metrics.replay(_source(req))
            return response
        if isinstance(outcome, records.Mismatch):
            _log(logging.WARNING, "idempotency key reused", "mismatch", req, 422)
            metrics.conflict(_source(req))
            raise Problem(
                "idempotency-key-reused",
                "this Idempotency-Key was used with a different request",
            )
        if isinstance(outcome, records.InFlight):
            _log(logging.INFO, "idempotency key in use", "in_flight", req, 409)
            raise Problem(
                "idempotency-key-in-use",
                "a request with this Idempotency-Key is being processed; retry later",
                headers={"Retry-After": str(outcome.retry_after)},
            )
        return _execute(req, outcome, view, args, kwargs)

    return cast(F, wrapper)


def _source(req: records.Request) -> str:
    # API events are stored under this source; metrics and logs say the same.
    return f"api:{req.client}"


def _log(level: int, message: str, outcome: str, req: records.Request, status: int) -> None:
    log.log(
        level,
        message,
        extra={
            "outcome": outcome,
            "source": _source(req),
            "client": req.client,
            "dedup_key": req.key,
            "status": status,
        },
    )


def _execute(
    req: records.Request,
    claimed: records.Claimed,
    view: Callable[..., Any],
    args: Any,
    kwargs: Any,
) -> Any:
    session = db.session
    try:
        # On SQLite the view runs in the writers' turn: hold() takes the
        # write lock for the whole view anyway, and waiting for a turn is
        # cheaper than polling for that lock. No turn within the busy
        # timeout is a 503 below, and the key is freed for the retry.
        with writer_turn():
            records.hold(claimed)
            try:
                rv = view(*args, **kwargs)
            except Exception as exc:
                # 4xx problems and HTTP errors are results worth replaying;
                # anything else re-raises and releases the key below.
                rv = current_app.handle_user_exception(exc)
                # A view that raised keeps none of its writes: only the answer
                # is saved (the lock is taken again where SQLite needs it).
                session.rollback()
                records.hold(claimed)
            response = current_app.make_response(rv)
            if response.status_code >= 500:
                session.rollback()
                _release_quietly(claimed)
                return response
            records.complete(
                claimed, response.status_code, _saved_headers(response), response.get_data(), _now()
            )
            session.commit()
            _log(
                logging.INFO, "idempotent request completed", "completed", req, response.status_code
            )
            if response.status_code < 300:
                metrics.received(_source(req))
            return response
    except records.LeaseLost:
        session.rollback()
        _log(logging.WARNING, "idempotency lease lost", "lease_lost", req, 409)
        return problem_response(
            Problem(
                "idempotency-lease-lost",
                "the request took longer than its lease and was taken over; retry",
                headers={"Retry-After": "1"},
            )
        )
    except BaseException:
        session.rollback()
        _release_quietly(claimed)
        raise


def _release_quietly(claimed: records.Claimed) -> None:
    # If the database is what failed, the release fails too; the lease then
    # expires on its own and the next retry takes the key over.
    try:
        records.release(claimed)
    except Exception:
        db.session.rollback()
        log.warning("could not release idempotency claim %s", claimed.record_id, exc_info=True)
