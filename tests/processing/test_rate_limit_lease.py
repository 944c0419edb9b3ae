"""A rate limit's wait before a call never makes the attempt outlast its lease.

The worker starts when its lease exceeds twice every forward's timeout, but
a send the rate limit allows within a second is waited for in the
delivery's thread, before the call: with a short timeout that wait plus the
call outlasted the lease, and a second worker could claim the delivery and
send it again while the first was still sending.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from webhook_receiver.processing.outcomes import DELIVERED

from .conftest import config_with, forward, store_event

LEASE = 1.0
TIMEOUT = 0.45  # the lease exceeds twice it: the worker starts


class _Sink:
    """A loopback HTTP target answering 204 at once the first time, ``slow`` seconds later after."""

    def __init__(self, slow: float) -> None:
        self.answered: list[float] = []  # monotonic, when each answer went out
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if sink.answered:
                    time.sleep(slow)
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()
                self.wfile.flush()
                sink.answered.append(time.monotonic())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/billing"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def sink() -> Iterator[_Sink]:
    target = _Sink(slow=0.8 * TIMEOUT)
    yield target
    target.server.shutdown()
    target.server.server_close()


def test_rate_limit_wait_and_call_end_within_the_lease(make_app, make_worker, clock, sink):
    billing = forward("billing", sink.url, timeout_seconds=TIMEOUT, max_per_second=1)
    app = make_app(config_with([billing]), WORKER_LEASE_SECONDS=LEASE, WORKER_POLL_SECONDS=0.05)
    for key in ("evt-1", "evt-2"):
        store_event(app, clock, dedup_key=key)
    # The real time: the lease and the rate limit's slots are both real here.
    worker = make_worker(app, lambda: datetime.now(UTC))
    delivered = 0
    give_up = time.monotonic() + 10
    with app.app_context():
        while delivered < 2 and time.monotonic() < give_up:
            answers = len(sink.answered)
            started = time.monotonic()  # the claim comes after: its lease ends later
            outcome = worker.run_once()
            if outcome is None:
                time.sleep(0.02)
                continue
            delivered += outcome.outcome == DELIVERED
            for answered in sink.answered[answers:]:
                # The second send's slot is a second after the first: waited
                # for, then answered in 0.8x the timeout, past the lease.
                took = answered - started
                assert took < LEASE, f"answered {took:.2f} s into a {LEASE} s lease"
    assert delivered == 2
    assert len(sink.answered) == 2
