"""Prometheus metrics: what the receiver counts, and the ``/metrics`` endpoint.

Counting stays off the database and costs O(1): a labelled counter's
increment is a dictionary lookup and an add (an mmap write in multiprocess
mode). Under gunicorn, ``gunicorn.conf.py`` sets ``PROMETHEUS_MULTIPROC_DIR``
before any worker imports prometheus_client; each worker then writes its own
file there and a scrape, answered by any worker, sums the files of all of
them, live or dead.

Each app has its own registry (in ``app.extensions``), so tests read exact
counts of their own app. The module-level functions are what the rest of
the code calls; outside an app with metrics they do nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from flask import Blueprint, Flask, Response, current_app, g, request
from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from ..config import ConfigError
from ..extensions import db
from ..models import Delivery
from ..outbox import circuits
from ..outbox.deliveries import DEAD, PENDING
from ..problems import Problem
from ..processing import registry

EXTENSION = "webhook_receiver.metrics"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PREFIX = "webhook_receiver"

# Any other method (clients may send anything) is counted as "other", so that
# a label cannot grow without bound.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Webhook answers take milliseconds; the tail is the database waiting on a lock.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """One app's counters and histograms, on a registry of their own."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

        def counter(name: str, doc: str, labels: tuple[str, ...]) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=registry)

        self.received = counter(
            "received", "Events stored for the first time, per source.", ("source",)
        )
        self.duplicates = counter(
            "duplicates", "Redeliveries of a stored event (same key, same content).", ("source",)
        )
        # Two names for two things: a provider's dedup key stored with other
        # content (kept for review, the admin's Conflicts), and an API client
        # reusing an Idempotency-Key for another request (refused, not kept).
        self.conflicts = counter(
            "conflicts",
            "Deliveries and broker messages reusing a stored dedup key with other content "
            "(kept for review).",
            ("source",),
        )
        self.key_reuses = counter(
            "idempotency_key_reuses",
            "API requests reusing an Idempotency-Key with a different request (refused "
            "with 422, not kept).",
            ("source",),
        )
        self.signature_failures = counter(
            "signature_failures",
            "Deliveries refused as unauthentic, by reason (signature, timestamp, or unreadable "
            "before its signature could be checked).",
            ("source", "reason"),
        )
        # Authentic deliveries only: an unauthentic one is a signature failure.
        self.webhook_refusals = counter(
            "webhook_refusals",
            "Authentic deliveries refused for what they hold (no dedup key, invalid payload, "
            "unsupported media type), by reason.",
            ("source", "reason"),
        )
        self.broker_dead_letters = counter(
            "broker_dead_letters",
            "Broker messages dead-lettered by the consumer (conflict, no key, bad payload).",
            ("source", "reason"),
        )
        # Client names come from the config and reasons are problem types:
        # bounded, whatever a caller sends.
        self.api_refusals = counter(
            "api_refusals",
            "API requests answered with a 4xx problem (bad token, malformed Idempotency-Key, "
            "body not an event, media type, key in use or reused), by client and reason.",
            ("client", "reason"),
        )
        self.replays = counter(
            "replays", "Saved Idempotency-Key responses replayed, per source.", ("source",)
        )
        self.delivery_attempts = counter(
            "delivery_attempts",
            "Attempts to deliver an event to a consumer, by outcome.",
            ("source", "consumer", "outcome"),
        )
        self.dead_letters = counter(
            "dead_letters", "Deliveries given up on (dead letters).", ("source", "consumer")
        )
        # By operators in the admin, not by the worker: a separate counter,
        # so that attempts still add up to what the worker did.
        self.discarded = counter(
            "deliveries_discarded",
            "Dead deliveries an operator discarded (never to be retried).",
            ("source", "consumer"),
        )
        self.latency = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Time to answer a request, by endpoint, method and status class.",
            ("endpoint", "method", "status"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )


def multiprocess_dir() -> str | None:
    """The directory of multiprocess mode, when it is on."""
    return os.environ.get(MULTIPROC_ENV) or None


def _metrics() -> Metrics | None:
    return current_app.extensions.get(EXTENSION)


def received(source: str, count: int = 1) -> None:
    """Count an event stored for the first time (``count`` of them, for a batch)."""
    m = _metrics()
    if m is not None and count:
        m.received.labels(source).inc(count)


def duplicate(source: str, count: int = 1) -> None:
    """Count a redelivery of a stored event (``count`` of them, for a batch)."""
    m = _metrics()
    if m is not None and count:
        m.duplicates.labels(source).inc(count)


def conflict(source: str, count: int = 1) -> None:
    """Count a key reused with different content (``count`` of them), under its kind's name."""
    m = _metrics()
    if m is None or not count:
        return
    # The Idempotency-Key engine reports its mismatches here with the API's
    # source, ``api:<client>``; no webhook source can be named so.
    if source.startswith("api:"):
        m.key_reuses.labels(source).inc(count)
    else:
        m.conflicts.labels(source).inc(count)


def signature_failure(source: str, reason: str) -> None:
    """Count a delivery refused as unauthentic (``reason``: signature, timestamp, unreadable)."""
    m = _metrics()
    if m is not None:
        m.signature_failures.labels(source, reason).inc()


def webhook_refusal(source: str, reason: str) -> None:
    """Count an authentic delivery refused for what it holds (``reason``: the problem's slug)."""
    m = _metrics()
    if m is not None:
        m.webhook_refusals.labels(source, reason).inc()


def api_refusal(client: str | None, reason: str) -> None:
    """Count an API request answered with a 4xx problem (``client``: None when unauthenticated)."""
    m = _metrics()
    if m is not None:
        m.api_refusals.labels(client or "", reason).inc()


def broker_dead_letter(source: str, reason: str) -> None:
    """Count a broker message the consumer dead-lettered, by reason."""
    m = _metrics()
    if m is not None:
        m.broker_dead_letters.labels(source, reason).inc()


def replay(source: str) -> None:
    """Count a replayed Idempotency-Key response."""
    m = _metrics()
    if m is not None:
        m.replays.labels(source).inc()


def discarded(source: str, consumer: str, count: int = 1) -> None:
    """Count dead deliveries an operator discarded."""
    m = _metrics()
    if m is not None and count:
        m.discarded.labels(source, consumer).inc(count)


def _start_timer() -> None:
    g._metrics_started = time.perf_counter()


def _observe(response: Response) -> Response:
    started = g.pop("_metrics_started", None)
    m = _metrics()
    if started is not None and m is not None:
        method = request.method if request.method in _METHODS else "other"
        m.latency.labels(
            request.endpoint or "unmatched", method, f"{response.status_code // 100}xx"
        ).observe(time.perf_counter() - started)
    return response


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


def _authorized() -> bool:
    token = current_app.config.get("METRICS_TOKEN")
    if not token:
        return True
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # Digests are compared so that timing reveals nothing, not even the length.
    return scheme.lower() == "bearer" and hmac.compare_digest(
        _digest(given.strip()), _digest(str(token))
    )


bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
def expose() -> Response:
    """Expose the counters and histograms in the Prometheus text format."""
    if not _authorized():
        raise Problem(
            "unauthorized",
            "send Authorization: Bearer <WEBHOOK_RECEIVER_METRICS_TOKEN>",
            headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
        )
    if multiprocess_dir():
        # A fresh registry per scrape, as multiprocess mode requires: it reads
        # every worker's file.
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(_DeliveryBacklog())
        registry.register(_Circuits())
    else:
        registry = current_app.extensions[EXTENSION].registry
    # The Accept header picks the format: Prometheus text (0.0.4 unless a
    # newer one is asked for) or OpenMetrics.
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return Response(encode(registry), headers={"Content-Type": content_type})


class _DeliveryBacklog(Collector):
    """Deliveries due and not yet taken, read from the database at each scrape.

    Counters cannot say that work is waiting: a stopped worker counts
    nothing. The oldest due delivery's age can, whichever process answers.
    """

    DUE = (
        f"{PREFIX}_deliveries_due",
        "Pending deliveries whose attempt is due and that no worker has taken yet.",
    )
    OLDEST = (
        f"{PREFIX}_oldest_due_delivery_seconds",
        "How long the oldest due delivery has waited for a worker (0 when none).",
    )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Registering asks for this, outside any request: no query then.
        yield GaugeMetricFamily(*self.DUE)
        yield GaugeMetricFamily(*self.OLDEST)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = datetime.now(UTC)
        try:
            count, oldest = db.session.execute(
                select(func.count(), func.min(Delivery.next_attempt_at)).where(
                    Delivery.state == PENDING, Delivery.next_attempt_at <= now
                )
            ).one()
        except SQLAlchemyError:
            # The database away: the scrape still answers (readyz says why).
            return
        finally:
            db.session.rollback()
        age = 0.0 if oldest is None else max(0.0, (now - oldest).total_seconds())
        yield GaugeMetricFamily(*self.DUE, value=int(count or 0))
        yield GaugeMetricFamily(*self.OLDEST, value=age)


class _Circuits(Collector):
    """Each forward's circuit, read from the database at each scrape: 1 open or half-open, else 0.

    The worker that opens a circuit may not serve ``/metrics``: every
    process reads the same rows, so whichever answers the scrape tells.
    Forwards without a circuit breaker, or no longer configured, are left out.
    """

    OPEN = (
        f"{PREFIX}_circuit_open",
        "Whether a forward target's circuit is open or half-open (1) or closed (0).",
    )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(*self.OPEN, labels=("source", "consumer"))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        consumers = registry.get().consumers
        targets = [
            (source, name)
            for source, named in consumers.items()
            for name, consumer in named.items()
            if consumer.forward is not None and consumer.forward.circuit_breaker is not None
        ]
        try:
            found = {(c.source, c.consumer): c for c in circuits.read_all()} if targets else {}
        except SQLAlchemyError:
            return  # the database away: the scrape still answers (readyz says why)
        finally:
            db.session.rollback()
        family = GaugeMetricFamily(*self.OPEN, labels=("source", "consumer"))
        for source, name in sorted(targets):
            circuit = found.get((source, name))
            family.add_metric([source, name], 1 if circuit is not None and circuit.is_open else 0)
        yield family


def watch_deliveries(app: Flask) -> None:
    """Count the worker's attempts through the processing registry's outcome hooks."""
    m: Metrics = app.extensions[EXTENSION]

    def on_attempt(outcome: Any) -> None:
        source = outcome.source or "unknown"
        m.delivery_attempts.labels(source, outcome.consumer, outcome.outcome).inc()
        if outcome.outcome == DEAD:
            m.dead_letters.labels(source, outcome.consumer).inc()

    registry.get(app).outcome_hooks.append(on_attempt)


TOKEN_ENV = "WEBHOOK_RECEIVER_METRICS_TOKEN"


def _token_as_written(app: Flask) -> None:
    # Flask's from_prefixed_env reads each value as JSON when it can: a token
    # "0", "false", "null" or "[]" would become falsy (no token: /metrics open
    # to anyone) and "1e3" the float 1000.0. A token is the text as written.
    token = app.config.get("METRICS_TOKEN")
    raw = os.environ.get(TOKEN_ENV)
    if raw is not None and not isinstance(token, str):
        token = raw
    if token is not None and not isinstance(token, str):
        raise ConfigError(f"METRICS_TOKEN must be a string, got {type(token).__name__}")
    app.config["METRICS_TOKEN"] = token


def _make_multiprocess_dir() -> None:
    # gunicorn.conf.py makes it for the web processes; a worker or consumer
    # started first, or alone (a directory under /run emptied by a reboot),
    # would fail to open its file at every count, and lose the counts.
    path = multiprocess_dir()
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{MULTIPROC_ENV} {path!r} cannot be made: {exc.strerror}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{MULTIPROC_ENV} {path!r} is not a directory this process can write")


def init_app(app: Flask) -> None:
    """Give the app its metrics, time its requests and serve ``/metrics``."""
    _token_as_written(app)
    _make_multiprocess_dir()
    app.extensions[EXTENSION] = Metrics(CollectorRegistry(auto_describe=True))
    app.extensions[EXTENSION].registry.register(_DeliveryBacklog())
    app.extensions[EXTENSION].registry.register(_Circuits())
    # First of the before_request functions: a request refused by an earlier
    # one (problems.py's check of a chunked body) is timed too.
    app.before_request_funcs.setdefault(None, []).insert(0, _start_timer)
    app.after_request(_observe)
    app.register_blueprint(bp)
