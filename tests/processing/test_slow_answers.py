"""Targets that answer too slowly, or too much: an attempt ends within its forward's timeout.

requests' timeout bounds the connect and each read of the socket, not the
answer: a target that sends a byte a little more often than the timeout
kept the worker's thread for as long as it liked, past the delivery's
lease, after which a second worker claimed the delivery and sent it again.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import requests

from webhook_receiver.config.forwards import parse_forwards
from webhook_receiver.processing import forwarding

from ..servers import read_http_request
from .conftest import FAST, config_with, delivery, drain, forward, outgoing, store_event

# A trickle ends on its own after this long, so that a test of the defect
# fails rather than hangs.
TRICKLE_FOR = 8.0
TIMEOUT = 1.0


class Trickler:
    """A loopback HTTP target that reads the request, then sends its answer a byte at a time.

    ``head`` is sent at once; then one byte of ``drip`` every ``interval``
    seconds (well within the client's read timeout), for at most
    TRICKLE_FOR seconds, then the connection is closed.
    """

    def __init__(
        self, head: bytes, drip: bytes = b"a", interval: float = 0.2, *, answer_first: bool = False
    ) -> None:
        # answer_first: the first request on a connection gets a whole 200
        # at once (the connection is kept alive), the next one the trickle.
        self.answer_first = answer_first
        self.head = head
        self.drip = drip
        self.interval = interval
        self.requests = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/hooks"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                if self.answer_first:
                    if not self._read_request(conn):
                        return
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                if not self._read_request(conn):
                    return
                conn.sendall(self.head)
                ends = time.monotonic() + TRICKLE_FOR
                while time.monotonic() < ends and not self._stop.is_set():
                    conn.sendall(self.drip)
                    self._stop.wait(self.interval)
            except OSError:
                return  # the client gave up: what the test wants

    def _read_request(self, conn: socket.socket) -> bool:
        if read_http_request(conn) is None:
            return False
        self.requests += 1
        return True

    def close(self) -> None:
        self._stop.set()
        # Wake the accept: closing the listener does not.
        socket.create_connection(self._listener.getsockname()).close()
        self._thread.join(5)
        self._listener.close()


@pytest.fixture
def trickler() -> Iterator[list[Trickler]]:
    made: list[Trickler] = []
    yield made
    for server in made:
        server.close()


def _send(url: str, http: requests.Session | None = None) -> tuple[forwarding.Result, float]:
    [target] = parse_forwards([{"name": "slow", "url": url, "timeout_seconds": TIMEOUT}], "t")
    out = outgoing(correlation_id=None)
    session = http or requests.Session()
    started = time.monotonic()
    result = forwarding.send(session, "slow", target, out)
    elapsed = time.monotonic() - started
    if http is None:
        session.close()
    return result, elapsed


def test_a_status_line_trickled_past_the_timeout_ends_the_attempt_as_a_timeout(trickler):
    server = Trickler(b"HTTP/1.1 200 OK\r\nX-Slow: ", drip=b"a")
    trickler.append(server)
    result, elapsed = _send(server.url)
    assert elapsed < TIMEOUT + 0.5, f"the attempt took {elapsed:.1f} s, its timeout is 1 s"
    assert (result.ok, result.retryable) == (False, True)
    assert (result.error or "").startswith("timeout: "), result.error


def test_a_kept_alive_connection_trickling_its_next_answer_ends_within_the_timeout(trickler):
    server = Trickler(b"HTTP/1.1 200 OK\r\nX-Slow: ", answer_first=True)
    trickler.append(server)
    with requests.Session() as http:
        first, _ = _send(server.url, http)
        assert first.ok
        result, elapsed = _send(server.url, http)
    assert server.requests == 2, "the second attempt did not reuse the connection"
    assert elapsed < TIMEOUT + 0.5, f"the attempt took {elapsed:.1f} s, its timeout is 1 s"
    assert (result.ok, result.retryable) == (False, True)
    assert (result.error or "").startswith("timeout: "), result.error


def test_a_body_trickled_past_the_timeout_ends_the_attempt_on_its_status(trickler):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n"
    server = Trickler(head, drip=b"b")
    trickler.append(server)
    result, elapsed = _send(server.url)
    assert elapsed < TIMEOUT + 0.5, f"the attempt took {elapsed:.1f} s, its timeout is 1 s"
    # The target answered 200: the status is what counts.
    assert (result.ok, result.status) == (True, 200)


def test_a_never_ending_error_body_ends_the_attempt_within_its_timeout(trickler):
    head = b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n"
    server = Trickler(head, drip=b"1\r\nx\r\n")
    trickler.append(server)
    result, elapsed = _send(server.url)
    assert elapsed < TIMEOUT + 0.5, f"the attempt took {elapsed:.1f} s, its timeout is 1 s"
    assert (result.ok, result.retryable, result.status) == (False, True, 503)


def test_a_trickling_target_is_retried_by_the_worker_within_the_forward_timeout(
    make_app, clock, make_worker, trickler
):
    server = Trickler(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    trickler.append(server)
    app = make_app(config_with([forward("slow", server.url, timeout_seconds=TIMEOUT)]), **FAST)
    event_id = store_event(app, clock, dedup_key="evt-1")
    started = time.monotonic()
    assert drain(app, make_worker(app, clock)) == ["retry"]
    elapsed = time.monotonic() - started
    # Past the lease (5 s here), another worker would have claimed it and sent it again.
    assert elapsed < TIMEOUT + 1, f"the attempt held the worker {elapsed:.1f} s"
    row = delivery(app, event_id, "slow")
    assert row["state"] == "pending"
    assert row["last_error"].startswith("timeout: ")
    assert server.requests == 1
