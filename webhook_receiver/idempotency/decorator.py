"""``@idempotent``: make any Flask view safe to retry under an Idempotency-Key.

By default the claim, the view's writes and the saved response are one
transaction: a retry sees either nothing or the whole, and a racing request
with the key waits for the holder's commit, then replays. With
``two_phase=True`` the claim commits on its own first, so concurrent retries
see it (409) and a crashed holder's lease can expire; the view's writes and
the saved response then commit together. A request the view refuses before
it begins its work (``Refused``) binds nothing. See docs/idempotency.md.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast, overload
from urllib.parse import parse_qsl, urlencode

from flask import Response, current_app, g, request
from werkzeug.exceptions import HTTPException

from ..fingerprint import JSONError, canonical_json, fingerprint, is_json_type, loads
from ..observability import metrics
from ..problems import Problem, problem_response
from .keys import parse_key
from .persistence import Persistence, RunAgain, records

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# Only these response headers are replayed: the ones that describe the
# result. Cookies, credentials, hop-by-hop and per-response headers never are.
_REPLAYED_HEADERS = frozenset(
    {"content-type", "location", "etag", "link", "content-language", "last-modified"}
)
_NEVER_REPLAYED = frozenset({"x-request-id", "x-correlation-id"})
# Where request_fingerprint leaves a JSON body it parsed, for the view.
JSON_BODY = "webhook_receiver.json_body"
# Answers about the request's form (too large, a media type the view cannot
# read), raised while reading it (Werkzeug raises them too): the work never began.
_REFUSED_STATUSES = frozenset({413, 415})


class Refused(Problem):
    """A refusal of the request before the view began its work: answered, never saved.

    As Stripe saves a result only once an endpoint began executing, a body
    that does not parse or validate binds nothing: the key stays free for
    the corrected request. A view raises it before any work (no write, no
    call to another service); a 4xx decided after is a plain ``Problem``,
    saved and replayed.
    """


def refused_before_execution(exc: BaseException) -> bool:
    """Whether a view's exception refuses the request before its work began (saved: no)."""
    if isinstance(exc, Problem):
        return isinstance(exc, Refused) or exc.status in _REFUSED_STATUSES
    return isinstance(exc, HTTPException) and exc.code in _REFUSED_STATUSES


def request_fingerprint() -> str:
    """Fingerprint the current request: method, path, query and the (canonical) body.

    A body that is not JSON is read as its media type says, so that type
    is fingerprinted with it: the same bytes as text/plain and as JSON, or
    as a form, are two requests. A JSON body's fingerprint is its canonical
    document alone. A JSON body, once parsed, is left in the request's
    environ under ``JSON_BODY`` as (document, canonical bytes), so the view
    need not parse and serialise it again.
    """
    body = request.get_data(cache=True)
    parsed = False
    if is_json_type(request.content_type):
        try:
            document = loads(body)
            body = canonical_json(document)
            request.environ[JSON_BODY] = (document, body)
            parsed = True
        except JSONError:
            pass  # not JSON after all: the raw bytes are the content
    # Byte for byte (latin-1 both ways): an escape that is not UTF-8 (%FF,
    # %FE) keeps its byte, as request.args keeps it, where UTF-8 made
    # them all U+FFFD. A UTF-8 query comes out as it did.
    pairs = parse_qsl(request.query_string.decode("latin-1"), True, encoding="latin-1")
    query = urlencode(sorted(pairs), encoding="latin-1")
    parts: list[bytes | str] = [request.method, request.path, query, body]
    if body and not parsed:
        # Only then parsed: JSON's hot path is spared it. Without a body the
        # type says nothing, and a bodiless request keeps the fingerprint its
        # record was saved under before types counted (a retry across the
        # upgrade replays rather than 422).
        parts.append(request.mimetype)
    return fingerprint(parts)


def _saved_headers(response: Response) -> list[list[str]]:
    saved = []
    for name, value in response.headers.items():
        lower = name.lower()
        if lower in _REPLAYED_HEADERS or (lower.startswith("x-") and lower not in _NEVER_REPLAYED):
            saved.append([name, value])
    return saved


def _now() -> datetime:
    return datetime.now(UTC)


@overload
def idempotent(
    view: F,
    *,
    two_phase: bool = False,
    speculative: bool = False,
    persistence: Persistence | None = None,
) -> F: ...


@overload
def idempotent(
    view: None = None,
    *,
    two_phase: bool = False,
    speculative: bool = False,
    persistence: Persistence | None = None,
) -> Callable[[F], F]: ...


def idempotent(
    view: F | None = None,
    *,
    two_phase: bool = False,
    speculative: bool = False,
    persistence: Persistence | None = None,
) -> F | Callable[[F], F]:
    """Run a view at most once per (client, Idempotency-Key); replay its response after.

    Needs ``g.client`` (the authenticated client's name) set before it runs.
    The view must not commit: its writes commit together with the saved
    response, or not at all. By default the claim is part of that one
    transaction, which suits a view whose effects are all in this database.
    ``two_phase=True`` commits the claim first, under a lease, for a view
    that calls other services: concurrent retries then get 409 at once
    instead of waiting, and a holder that outlives its lease is fenced.

    ``speculative=True`` (one commit only) saves a new key its read while
    retries are rare (see ``TakenKeys``): the view runs without the key
    being read first, and if the key turns out taken, its writes are
    rolled back and the saved answer is replayed. The view's code may then
    run for a retry, so it suits a view whose only effects are its writes
    in this database, as ``POST /api/events``.

    ``persistence`` keeps the records (default: ``Persistence``, this
    app's database); a view may pass one that writes its own rows with
    the record more cheaply (api/event_records.py).
    """
    if two_phase and speculative:
        raise ValueError("a two-phase claim commits before the view: it cannot be speculative")

    store = persistence or Persistence()

    def decorate(view: F) -> F:
        taken = TakenKeys(speculative)

        @functools.wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            client = g.get("client")
            if client is None:
                # A developer's mistake, said plainly: keys need a scope.
                raise RuntimeError(
                    f"@idempotent on {request.endpoint} needs the request's client in g.client "
                    "(its keys' scope): put the view behind require_client "
                    "(webhook_receiver.api.auth), or set g.client before it"
                )
            key = parse_key(request.headers)
            assert key is not None
            req = records.Request(
                client=client,
                key=key,
                fingerprint=request_fingerprint(),
                method=request.method,
                path=request.path,
            )
            if two_phase:
                return _two_phase(store, req, view, args, kwargs)
            return _one_commit(store, req, view, args, kwargs, taken)

        return cast(F, wrapper)

    return decorate if view is None else decorate(view)


def _answer(
    req: records.Request, outcome: records.Replay | records.Mismatch | records.InFlight
) -> Response:
    """Answer a request whose key is already settled or held elsewhere."""
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
    _log(logging.INFO, "idempotency key in use", "in_flight", req, 409)
    raise _in_use(outcome.retry_after)


def _in_use(retry_after: int) -> Problem:
    return Problem(
        "idempotency-key-in-use",
        "a request with this Idempotency-Key is being processed; retry later",
        headers={"Retry-After": str(retry_after)},
    )


def _completed(req: records.Request, response: Response) -> Response:
    """Log and count a request whose answer was saved under its key."""
    _log(logging.INFO, "idempotent request completed", "completed", req, response.status_code)
    if response.status_code < 300:
        metrics.received(_source(req))
    return response


# -- one commit: the claim, the view's writes and the response together ------


class _KeyTaken(Exception):
    """A racing request with the key committed first: roll back, answer from its record."""


class _NotSaved(Exception):
    """A 5xx or a refusal: roll everything back, release any claim, send it unsaved."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status)
        self.response = response


class TakenKeys:
    """The share of a view's recent requests whose key was taken already: retries, mostly.

    It decides whether a speculative view's request reads its key's record
    before running the view. Reading first is the cheapest answer to a
    retry, the read being its whole cost, but it costs every new key a
    round trip. Running the view at once saves that round trip; a retry
    then runs the view too, its claim finds the key taken, its writes roll
    back, and it is answered from the record read after. With fewer than a
    fifth of recent requests retries (a moving average over about the last
    30), the view runs at once. Either way the claim's unique constraint
    decides, so only the cost depends on it.
    """

    # A retry run at once costs about three reads more than reading first
    # (its view, its failed claim) and a new key saves one: break-even near
    # a quarter; a fifth leaves room.
    READ_FIRST_ABOVE = 0.2
    _WEIGHT = 1 / 32  # of the latest request in the moving average

    def __init__(self, speculative: bool) -> None:
        self.speculative = speculative
        self.share = 0.0

    def read_first(self) -> bool:
        # A view that is not speculative always reads first.
        return not self.speculative or self.share > self.READ_FIRST_ABOVE

    def note(self, *, taken: bool) -> None:
        # Racing updates from threads may lose one: only an estimate.
        self.share += ((1.0 if taken else 0.0) - self.share) * self._WEIGHT


def _one_commit(
    store: Persistence,
    req: records.Request,
    view: Callable[..., Any],
    args: Any,
    kwargs: Any,
    taken: TakenKeys,
) -> Any:
    config = current_app.config
    ttl = timedelta(seconds=int(config["IDEMPOTENCY_TTL_SECONDS"]))
    lock_timeout = float(config["IDEMPOTENCY_LOCK_TIMEOUT_SECONDS"])
    # Read first (most requests that find a record are retries, and a lone
    # read is their whole cost) unless the view is speculative and retries rare.
    read_first = taken.read_first()
    for _ in range(5):
        failed: Exception | None = None
        unsaved = False
        # The read and (on PostgreSQL) the one-statement write share a connection.
        with store.connection():
            if read_first:
                outcome = store.find(req, _now())
                if outcome is not None:
                    taken.note(taken=True)
                    return _answer(req, outcome)
            try:
                response = _run_in_one_transaction(
                    store, req, view, args, kwargs, ttl, lock_timeout
                )
            except _NotSaved as not_saved:
                # A 5xx or a refusal: nothing was committed.
                response, unsaved = not_saved.response, True
            except Exception as exc:
                if read_first:
                    raise
                failed, response = exc, None
        if not read_first:
            if failed is not None or unsaved:
                # The view ran before the key was read, and nothing was
                # committed: for a retry, its saved answer wins (and a
                # refused body under a taken key is a 422, as if read first).
                outcome = _find_after_failure(store, req)
                if outcome is not None:
                    taken.note(taken=True)
                    return _answer(req, outcome)
            if failed is not None:
                raise failed
        if response is not None:
            taken.note(taken=False)
            return response
        # The key was taken (a retry, or a racing request that committed
        # first): answer from its record. Or the persistence could not
        # save the unit as it stood: run again. Either way, read first.
        read_first = True
    raise RuntimeError("idempotency key did not settle")  # pragma: no cover


def _find_after_failure(
    store: Persistence, req: records.Request
) -> records.Replay | records.Mismatch | records.InFlight | None:
    """The key's record after a speculative run failed; None if free or unreadable."""
    try:
        return store.find(req, _now())
    except Exception:
        return None  # the database is what failed: the run's own error stands


def _run_in_one_transaction(
    store: Persistence,
    req: records.Request,
    view: Callable[..., Any],
    args: Any,
    kwargs: Any,
    ttl: timedelta,
    lock_timeout: float,
) -> Response | None:
    """Claim, run the view and save its answer in one transaction; None if the key was taken.

    Raises ``_NotSaved``, everything rolled back, for a 5xx or a refusal.
    """
    try:
        # One transaction: the view's writes, then the claim and the saved
        # answer in one statement. On SQLite the writers' turn is taken at
        # the view's first statement and held to the commit, so the view's
        # reads and writes run under the write lock.
        with store.transaction() as unit:
            raised = refused = False
            try:
                rv = view(*args, **kwargs)
            except Exception as exc:
                # 4xx problems and HTTP errors are results worth replaying;
                # anything else re-raises and rolls everything back.
                rv = current_app.handle_user_exception(exc)
                raised, refused = True, refused_before_execution(exc)
            response = current_app.make_response(rv)
            if response.status_code >= 500 or refused:
                # Nothing is committed: the key is free for the retry.
                raise _NotSaved(response)
            if raised:
                # A view that raised keeps none of its writes: only its
                # answer is saved.
                unit.discard()
            saved = (response.status_code, _saved_headers(response), response.get_data())
            if not unit.save(req, saved, _now(), ttl, lock_timeout):
                raise _KeyTaken()
    except (_KeyTaken, RunAgain):
        # The key was taken (answer from its record), or the unit could
        # not be saved as it stood (run it again).
        return None
    except records.KeyLocked:
        _log(logging.INFO, "idempotency key in use", "in_flight", req, 409)
        return problem_response(_in_use(retry_after=1))
    return _completed(req, response)


# -- two phases: the claim commits first, under a lease ----------------------


def _two_phase(
    store: Persistence, req: records.Request, view: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    config = current_app.config
    lease = timedelta(seconds=int(config["IDEMPOTENCY_LEASE_SECONDS"]))
    ttl = timedelta(seconds=int(config["IDEMPOTENCY_TTL_SECONDS"]))
    outcome = store.claim(req, _now(), lease, ttl)
    if isinstance(outcome, records.Claimed):
        return run_claimed(req, outcome, view, args, kwargs, store)
    return _answer(req, outcome)


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


def run_claimed(
    req: records.Request,
    claimed: records.Claimed,
    view: Callable[..., Any],
    args: Any,
    kwargs: Any,
    store: Persistence | None = None,
) -> Any:
    """Run the view under a two-phase claim and save its answer, fenced by the lease token.

    A holder whose lease was taken over answers 409 ``idempotency-lease-lost``
    and keeps none of its writes; the new holder's record is left as it is.
    """
    store = store or Persistence()
    try:
        # On SQLite the view runs in the writers' turn (the unit of work's):
        # the claimed transaction takes the write lock for the whole view
        # anyway, and waiting for a turn is cheaper than polling for that
        # lock. No turn within the busy timeout is a 503 below, and the key
        # is freed for the retry.
        with store.claimed_transaction(claimed) as unit:
            refused = False
            try:
                rv = view(*args, **kwargs)
            except Exception as exc:
                # 4xx problems and HTTP errors are results worth replaying;
                # anything else re-raises and releases the key below.
                rv = current_app.handle_user_exception(exc)
                refused = refused_before_execution(exc)
                if not refused:
                    # A view that raised keeps none of its writes: only the
                    # answer is saved.
                    unit.discard()
            response = current_app.make_response(rv)
            if response.status_code >= 500 or refused:
                # Nothing is saved, and the claim is released: the key is
                # free for the retry.
                raise _NotSaved(response)
            unit.complete(
                response.status_code, _saved_headers(response), response.get_data(), _now()
            )
    except _NotSaved as unsaved:
        _release_quietly(store, claimed)
        return unsaved.response
    except records.LeaseLost:
        _log(logging.WARNING, "idempotency lease lost", "lease_lost", req, 409)
        return problem_response(
            Problem(
                "idempotency-lease-lost",
                "the request took longer than its lease and was taken over; retry",
                headers={"Retry-After": "1"},
            )
        )
    except BaseException:
        _release_quietly(store, claimed)
        raise
    return _completed(req, response)


def _release_quietly(store: Persistence, claimed: records.Claimed) -> None:
    # If the database is what failed, the release fails too; the lease then
    # expires on its own and the next retry takes the key over.
    try:
        store.release(claimed)
    except Exception:
        log.warning("could not release idempotency claim %s", claimed.record_id, exc_info=True)
