"""Real processes racing on one Idempotency-Key: gunicorn workers, threads, a flaky network."""

from __future__ import annotations

import socket
import struct
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import requests
import urllib3
from requests.adapters import HTTPAdapter
from sqlalchemy import create_engine

from webhook_receiver.models import IdempotencyRecord

from ..conftest import ACME_TOKEN
from ..helpers import count_at
from ..servers import gunicorn, read_http_request

pytestmark = pytest.mark.slow

CONFIG_TOML = f'[clients.acme]\ntoken = "{ACME_TOKEN}"\n'
N = 50
BODY = {"type": "order.created", "data": {"order": 42, "lines": [1, 2, 3]}}


def workers_for(db_url: str) -> int:
    # SQLite serialises writers; two workers are what it is configured for.
    return 2 if db_url.startswith("sqlite") else 4


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ACME_TOKEN}", "Idempotency-Key": key}


def race(url: str, keys: list[str]) -> list[requests.Response]:
    """Send one POST per key from its own thread, all released at once."""
    barrier = threading.Barrier(len(keys), timeout=30)

    def send(key: str) -> requests.Response:
        with requests.Session() as session:
            # Prepared before the barrier, so that the requests leave together.
            prepared = session.prepare_request(
                requests.Request("POST", url + "/api/events", json=BODY, headers=headers(key))
            )
            barrier.wait()
            return session.send(prepared, timeout=30)

    with ThreadPoolExecutor(max_workers=len(keys)) as pool:
        return list(pool.map(send, keys))


def overlapping(tmp_path) -> tuple[str, ...]:
    """Gunicorn arguments that hold each request a moment before the app sees it.

    On two cores the first request would otherwise finish before the others
    are even sent; the pause (no CPU used) lets each worker's request reach
    the engine together with the others', so the claim is really raced.
    """
    conf = tmp_path / "gunicorn_overlap.py"
    conf.write_text("import time\n\ndef pre_request(worker, req):\n    time.sleep(0.05)\n")
    return ("--config", str(conf))


def test_concurrent_identical_requests_store_one_event(db_url, tmp_path):
    with gunicorn(
        db_url, CONFIG_TOML, tmp_path, workers=workers_for(db_url), args=overlapping(tmp_path)
    ) as server:
        responses = race(server.url, ["the-one-key"] * N)
        log = server.log()

    statuses = sorted(r.status_code for r in responses)
    # Replays, or 409 for a request that waited on the holder past the lock
    # timeout; never a 5xx.
    assert all(s in (201, 409) for s in statuses), (statuses, log)
    created = [r for r in responses if r.status_code == 201]
    assert created, statuses
    # The claim commits with the event: the request that made it answers.
    originals = [r for r in created if "Idempotent-Replayed" not in r.headers]
    assert len(originals) == 1
    # Every 201, original or replay, is the same answer byte for byte.
    assert len({r.content for r in created}) == 1
    assert len({r.headers["Location"] for r in created}) == 1
    assert all(r.headers["Content-Type"] == "application/json" for r in created)
    for r in responses:
        if r.status_code == 409:
            assert r.headers["Content-Type"] == "application/problem+json"
            assert r.json()["type"] == "/problems/idempotency-key-in-use"
            assert int(r.headers["Retry-After"]) >= 1
    assert count_at(db_url) == 1
    assert count_at(db_url, IdempotencyRecord) == 1


def test_concurrent_distinct_keys_store_one_event_each(db_url, tmp_path):
    keys = [f"key-{i}-{uuid.uuid4().hex[:8]}" for i in range(N)]
    with gunicorn(
        db_url, CONFIG_TOML, tmp_path, workers=workers_for(db_url), args=overlapping(tmp_path)
    ) as server:
        responses = race(server.url, keys)
        log = server.log()

    assert [r.status_code for r in responses] == [201] * N, log
    assert not any("Idempotent-Replayed" in r.headers for r in responses)
    assert len({r.json()["id"] for r in responses}) == N
    assert count_at(db_url) == N
    assert count_at(db_url, IdempotencyRecord) == N


# -- a retry by a real client library ---------------------------------------


class DroppingProxy:
    """A loopback TCP proxy that loses the first response: the server acted, the client never heard.

    Each client connection carries one request (gunicorn's sync workers
    close after every response). The proxy forwards the request, waits for
    the whole response, and then, for the first ``drop`` connections, resets
    the client's socket instead of passing the response on.
    """

    def __init__(self, upstream_port: int, *, drop: int = 1, timeout: float = 10) -> None:
        self.upstream_port = upstream_port
        self.drop = drop
        self.timeout = timeout
        self.forwarded: list[bytes] = []  # the first line of each request sent upstream
        self.dropped = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.timeout)
            request = read_http_request(conn)
            if request is None:
                return
            with socket.create_connection(
                ("127.0.0.1", self.upstream_port), timeout=self.timeout
            ) as upstream:
                upstream.sendall(request)
                response = _read_until_closed(upstream)
            with self._lock:
                self.forwarded.append(request.split(b"\r\n", 1)[0])
                lose = self.dropped < self.drop
                if lose:
                    self.dropped += 1
            if lose:
                # SO_LINGER 0: close with a RST, as a crashed middlebox would.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            conn.sendall(response)

    def __enter__(self) -> DroppingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._listener.close()
        self._thread.join(timeout=5)


def _read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


@contextmanager
def retrying_session(total: int = 3) -> Iterator[requests.Session]:
    """A requests session whose urllib3 Retry resends POSTs, as many client SDKs configure."""
    retry = urllib3.util.Retry(
        total=total,
        allowed_methods=frozenset({"POST"}),
        status_forcelist=[409, 502, 503],
        backoff_factor=0.1,
        # Retry-After on a 409 is the lease's remaining time (up to a
        # minute); the tests retry on their own short backoff instead.
        respect_retry_after_header=False,
        raise_on_status=False,
    )
    with requests.Session() as session:
        session.mount("http://", HTTPAdapter(max_retries=retry))
        yield session


def test_urllib3_retry_after_a_lost_response_creates_one_event(db_url, tmp_path):
    with (
        gunicorn(db_url, CONFIG_TOML, tmp_path, workers=2) as server,
        DroppingProxy(int(server.url.rsplit(":", 1)[1])) as proxy,
        retrying_session() as session,
    ):
        response = session.post(
            proxy.url + "/api/events", json=BODY, headers=headers("retried-key"), timeout=20
        )
        # The saved response can be read back directly, without the proxy.
        event = requests.get(
            server.url + response.headers["Location"], headers=headers("unused"), timeout=5
        )

    assert proxy.dropped == 1
    assert proxy.forwarded == [b"POST /api/events HTTP/1.1"] * 2
    assert response.status_code == 201
    assert response.headers["Idempotent-Replayed"] == "true"
    doc = response.json()
    assert doc["type"] == "order.created"
    assert doc["data"] == BODY["data"]
    assert event.status_code == 200
    assert event.json()["id"] == doc["id"]
    assert count_at(db_url) == 1
    assert count_at(db_url, IdempotencyRecord) == 1


@contextmanager
def events_table_locked(db_url: str, seconds: float) -> Iterator[None]:
    """Block writes for ``seconds`` from another connection, as a slow transaction would.

    PostgreSQL: a SHARE lock on the events table, so the view waits on its
    INSERT with the key in flight (and retries wait on its record). SQLite
    has only the database-wide write lock, so there the claim itself waits.
    """
    engine = create_engine(db_url)
    conn = engine.connect()
    if engine.dialect.name == "postgresql":
        conn.exec_driver_sql("BEGIN")
        conn.exec_driver_sql("LOCK TABLE events IN SHARE MODE")
    else:
        conn.connection.driver_connection.isolation_level = None
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    timer = threading.Timer(seconds, conn.rollback)
    timer.start()
    try:
        yield
    finally:
        timer.join(timeout=seconds + 5)
        conn.close()
        engine.dispose()


def test_urllib3_retry_after_a_client_timeout_waits_out_the_in_flight_original(db_url, tmp_path):
    with (
        gunicorn(db_url, CONFIG_TOML, tmp_path, workers=workers_for(db_url)) as server,
        retrying_session(total=8) as session,
        events_table_locked(db_url, 0.8),
    ):
        # The read timeout gives up on the original while it waits on the
        # lock; urllib3 resends, and each attempt waits on the lock as well.
        response = session.post(
            server.url + "/api/events",
            json=BODY,
            headers=headers("timed-out-key"),
            timeout=(5, 0.3),
        )
        log = server.log()

    assert response.status_code == 201, (response.text, log)
    # Every attempt waited (on the events table, then on the first record
    # written under the key, or on SQLite for the write lock): the first to
    # commit holds the key and the others replay it. The one we waited for
    # may be any of them.
    assert response.json()["data"] == BODY["data"]
    assert count_at(db_url) == 1
    assert count_at(db_url, IdempotencyRecord) == 1
