"""Fixtures for processing: a real downstream HTTP server, a fake clock, in-process workers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import select

from webhook_receiver import inbox
from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery
from webhook_receiver.processing import forwarding
from webhook_receiver.processing.worker import Worker

from ..brokers.conftest import amqp_queue, jetstream, nats_url, rabbit_url  # noqa: F401
from ..conftest import CLIENTS
from . import handlers as test_handlers

SOURCE = "shop"
BLOCK_TIMEOUT = 30.0


@dataclass
class Call:
    """One request the downstream received."""

    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b"ok"
    delay: float = 0.0


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client killed or timed out mid-request: expected here


class Downstream:
    """An idempotent downstream on a loopback port: it applies each Idempotency-Key once.

    ``replies[path]`` scripts the answers of a path, in order (then 200).
    A path in ``blocking`` holds a first-seen key's request, after applying
    it, until ``gate`` is set: the side effect is done but the answer is not
    back, which is where a worker crash hurts.
    """

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.applied: list[str] = []
        self.replies: dict[str, list[Reply]] = {}
        self.blocking: set[str] = set()
        self.gate = threading.Event()
        self.arrived = threading.Event()
        self.delay = 0.0
        self._lock = threading.Lock()
        self.server = _QuietServer(("127.0.0.1", 0), self._handler_class())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        downstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Without these, Nagle's algorithm and delayed ACKs add 40 ms a call.
            disable_nagle_algorithm = True
            wbufsize = 1 << 16

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                reply, block = downstream._receive(self.path, dict(self.headers), body)
                if block:
                    downstream.gate.wait(BLOCK_TIMEOUT)
                if reply.delay or downstream.delay:
                    time.sleep(reply.delay or downstream.delay)
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def _receive(self, path: str, headers: dict[str, str], body: bytes) -> tuple[Reply, bool]:
        with self._lock:
            self.calls.append(Call(path, headers, body))
            script = self.replies.get(path)
            reply = script.pop(0) if script else Reply()
            key = headers.get("Idempotency-Key", "")
            first = key not in self.applied
            # An idempotent downstream applies a key once, and only on success.
            if first and 200 <= reply.status < 300:
                self.applied.append(key)
            self.arrived.set()
            return reply, first and path in self.blocking and not self.gate.is_set()

    def calls_to(self, path: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.path == path]

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


@pytest.fixture
def downstream() -> Iterator[Downstream]:
    server = Downstream()
    server.start()
    try:
        yield server
    finally:
        server.close()


class Clock:
    """A clock the test moves by hand; whole seconds, so HTTP dates are exact."""

    def __init__(self) -> None:
        self.now = datetime.now(UTC).replace(microsecond=0)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def forward(name: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": url, "timeout_seconds": 1, **extra}


def outgoing(
    key: str = "evt-1", body: bytes = b"{}", correlation_id: str | None = "req-1"
) -> forwarding.Outgoing:
    """An event as the worker hands it to ``forwarding.send``: shop's order.paid, JSON."""
    return forwarding.Outgoing(
        event_id=1,
        source="shop",
        dedup_key=key,
        event_type="order.paid",
        content_type="application/json",
        body=body,
        correlation_id=correlation_id,
    )


def config_with(
    forwards: list[dict[str, Any]] | None = None,
    *,
    handlers: bool = False,
    ordered: bool = False,
    client_forwards: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A receiver config: the test clients and one generic source ``shop``."""
    source: dict[str, Any] = {
        "provider": "generic",
        "secrets": ["shop-secret-0123456789"],
        "signature_header": "X-Signature",
    }
    if forwards:
        source["forward"] = forwards
    if ordered:
        source["version"] = "json:/data/object/version"
        source["entity"] = "json:/data/object/id"
    clients = {name: dict(table) for name, table in CLIENTS.items()}
    if client_forwards:
        clients["acme"]["forward"] = client_forwards
    config: dict[str, Any] = {"clients": clients, "sources": {SOURCE: source}}
    if handlers:
        config["handlers"] = ["tests.processing.handlers"]
    return config


FAST = {
    "WORKER_LEASE_SECONDS": 5,
    "WORKER_POLL_SECONDS": 0.05,
    "WORKER_BACKOFF_BASE_SECONDS": 1,
    "WORKER_BACKOFF_MAX_SECONDS": 1000,
}


@pytest.fixture
def make_worker() -> Iterator[Callable[..., Worker]]:
    """In-process workers; ``rand`` defaults to 1.0 so the backoff is exactly its step."""
    made: list[Worker] = []

    def factory(app: Flask, clock: Clock, rand: Callable[[], float] = lambda: 1.0) -> Worker:
        worker = Worker(app, clock=clock, rand=rand)
        made.append(worker)
        return worker

    yield factory
    for worker in made:
        worker.http.close()


def store_event(
    app: Flask,
    clock: Clock,
    *,
    dedup_key: str,
    event_type: str = "order.paid",
    data: Any = None,
    source: str = SOURCE,
    correlation_id: str | None = None,
    body: bytes | None = None,
    content_type: str = "application/json",
) -> int:
    """Store an event through the inbox (so its deliveries are written) and commit."""
    if body is None:
        body = json.dumps({"type": event_type, "data": data or {}}).encode()
    with app.app_context():
        outcome = inbox.receive(
            inbox.Message(
                source=source,
                dedup_key=dedup_key,
                fingerprint="f" * 64,
                body=body,
                event_type=event_type,
                content_type=content_type,
                correlation_id=correlation_id,
                received_at=clock(),
            )
        )
    assert isinstance(outcome, inbox.Accepted)
    return outcome.event_id


def delivery_rows(app: Flask) -> list[dict[str, Any]]:
    """Every delivery as a dict, by id."""
    with app.app_context():
        rows = db.session.scalars(select(Delivery).order_by(Delivery.id)).all()
        result = [
            {c.name: getattr(row, c.name) for c in Delivery.__table__.columns} for row in rows
        ]
        db.session.rollback()
        return result


def delivery(app: Flask, event_id: int, consumer: str) -> dict[str, Any]:
    """One delivery as a dict."""
    matches = [
        r for r in delivery_rows(app) if r["event_id"] == event_id and r["consumer"] == consumer
    ]
    assert len(matches) == 1, matches
    return matches[0]


def drain(app: Flask, worker: Worker, limit: int = 50) -> list[str]:
    """Run due deliveries until none is due; the outcomes, in order."""
    outcomes = []
    with app.app_context():
        for _ in range(limit):
            outcome = worker.run_once()
            if outcome is None:
                return outcomes
            outcomes.append(outcome.outcome)
    raise AssertionError(f"still deliveries due after {limit}: {outcomes}")


@pytest.fixture(autouse=True)
def _reset_handlers() -> Iterator[None]:
    test_handlers.reset()
    yield
    test_handlers.reset()


@pytest.fixture
def ledger(make_app: Callable[..., Flask]) -> Iterator[Callable[[Flask], list[tuple[int, str]]]]:
    """The handlers' own table, created in this test's database; a reader of its rows."""
    created: list[Flask] = []

    def rows(app: Flask) -> list[tuple[int, str]]:
        with app.app_context():
            if app not in created:
                test_handlers.ledger.create(db.engine, checkfirst=True)
                created.append(app)
            result = db.session.execute(
                select(test_handlers.ledger.c.event_id, test_handlers.ledger.c.consumer).order_by(
                    test_handlers.ledger.c.id
                )
            )
            found = [tuple(r) for r in result]
            db.session.rollback()
            return found  # type: ignore[return-value]

    yield rows
    for app in created[:1]:
        with app.app_context():
            db.session.remove()
            test_handlers.ledger.drop(db.engine, checkfirst=True)
