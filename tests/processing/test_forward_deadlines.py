"""Broker forwards' attempts bounded by timeout_seconds as a whole, connect included.

The worker's lease is only required to outlast twice the timeout. MQTT's
and JetStream's clients gave the connect and the wait for the broker's
acknowledgement the full timeout each (an attempt could take twice the
timeout); Redis's and SQS's gave the connect and each read of the socket
the full timeout, so a server answering a byte at a time, each a little
within the timeout, held one attempt for as long as it liked. A rediss://
connection's TLS handshake had a timeout of its own, after the connect's;
a RabbitMQ connection blocked by an alarm, then a fresh one blocked again,
took pika's blocked-connection timeout and then a whole timeout more, and
pika gave each of a RabbitMQ connect's tries (each address its host
resolves to, each of the URL's connection_attempts) a whole timeout, with
its retry_delay between them; a Pub/Sub publish the attempt gave up on
was sent later by the client's own retry (600 s by default).

Resolving the target's name counted against no timeout: getaddrinfo
blocks in C before any socket exists, so a slow resolver held an HTTP,
SQS, Redis or RabbitMQ attempt for as long as it took, and the connect
after it had a whole timeout of its own. There is no DNS server here:
``slow_dns`` stands in for the resolver alone (socket.getaddrinfo, for
made-up names answered with 127.0.0.1); the servers are real.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pytest
import requests

from webhook_receiver.config import ForwardConfig
from webhook_receiver.config.forwards import parse_forwards
from webhook_receiver.processing import deadline, forwarding, publishers

from .. import mosquitto
from ..brokers.cloud_fixtures import (  # noqa: F401  (fixtures)
    PROJECT,
    pubsub_host,
    pubsub_subscription,
    sqs_endpoint,
    sqs_queue,
)
from ..brokers.conftest import amqp_queue, rabbit_url  # noqa: F401  (fixtures)
from ..servers import Relay
from .conftest import Downstream, outgoing

TIMEOUT = 2.0


class _TricklingRelay(Relay):
    """A relay that passes the server's answers one byte every ``gap`` seconds.

    Each byte comes within a socket timeout of ``gap`` or more, so only a
    bound on the whole attempt ends it; the relay closes after ``lasts``
    seconds, so that a client without one fails the test rather than hang.
    """

    def __init__(self, port: int, *, gap: float, lasts: float) -> None:
        super().__init__(port)
        self._gap = gap
        self._ending = threading.Timer(lasts, self.close)
        self._ending.daemon = True
        self._ending.start()

    def close(self) -> None:
        self._ending.cancel()
        super().close()

    def _pass_on(self, data: bytes, sink: socket.socket, from_server: bool) -> None:
        if not from_server:
            super()._pass_on(data, sink, from_server)
            return
        for byte in data:
            time.sleep(self._gap)
            sink.sendall(bytes([byte]))


class _LateHandshakeRelay(Relay):
    """A relay that passes the broker's first answer ``late`` seconds late."""

    def __init__(self, port: int, *, late: float, hold_after: bytes | None = None) -> None:
        super().__init__(port, hold_after=hold_after)
        self._late = late
        self._answered: set[socket.socket] = set()
        self._seen = threading.Lock()

    def _held(self, server: socket.socket) -> bool:
        with self._seen:
            first = server not in self._answered
            self._answered.add(server)
        if first:
            time.sleep(self._late)
        return super()._held(server)


class _SlowSilentListener:
    """A listener whose TCP connect takes about a second, and which then answers nothing.

    Its accept queue holds one connection (``backlog=0``), filled at once:
    the kernel drops the client's SYN until the filler is taken (at
    ``free_after`` seconds), and the client's first retransmission (at
    about 1 s) gets through. A TLS client's ClientHello is never answered.
    """

    def __init__(self, *, free_after: float = 0.5) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=0)
        self.port: int = self._listener.getsockname()[1]
        self._sockets = [self._listener, socket.create_connection(("127.0.0.1", self.port))]
        self._freeing = threading.Timer(free_after, self._free)
        self._freeing.start()

    def _free(self) -> None:
        self._sockets.append(self._listener.accept()[0])

    def __enter__(self) -> _SlowSilentListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self._freeing.cancel()
        self._freeing.join()
        for sock in self._sockets:
            sock.close()


class _HeldListeners:
    """Listeners on one port of 127.0.0.1 (and ::1, if it has IPv6) whose connects never complete.

    Each accept queue holds one connection (``backlog=0``), filled at once
    and never taken: the kernel drops the client's SYNs, and a connect
    waits until its own timeout.
    """

    def __init__(self) -> None:
        self._sockets: list[socket.socket] = []
        for _ in range(20):
            self.close()
            listener = socket.create_server(("127.0.0.1", 0), backlog=0)
            self.port: int = listener.getsockname()[1]
            self._hold(listener, "127.0.0.1")
            if not socket.has_ipv6:
                return
            try:
                listener6 = socket.create_server(
                    ("::1", self.port), family=socket.AF_INET6, backlog=0
                )
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue  # taken on ::1: another port
                return  # no IPv6 loopback here
            self._hold(listener6, "::1")
            return
        raise RuntimeError("no port free on both 127.0.0.1 and ::1")

    def _hold(self, listener: socket.socket, host: str) -> None:
        self._sockets += [listener, socket.create_connection((host, self.port))]

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._sockets = []

    def __enter__(self) -> _HeldListeners:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StalledRelay(Relay):
    """A relay that passes nothing, either way, until ``release()``: then all it kept, in order.

    A network path that stalls: what the client sent is still delivered,
    late, unless the client took it back (a gRPC call cancelled by its
    deadline is never sent once the connection is not yet up).
    """

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self._flowing = threading.Event()

    def release(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._flowing.set()
        super().close()

    def _pass_on(self, data: bytes, sink: socket.socket, from_server: bool) -> None:
        self._flowing.wait()
        super()._pass_on(data, sink, from_server)


# AMQP 0-9-1: Connection.Blocked (class 10, method 60) on channel 0, as
# RabbitMQ sends it under a memory or disk alarm; Basic.Publish (60, 40).
_REASON = b"low on memory"
_BLOCKED_METHOD = struct.pack(">HHB", 10, 60, len(_REASON)) + _REASON
_BLOCKED = struct.pack(">BHI", 1, 0, len(_BLOCKED_METHOD)) + _BLOCKED_METHOD + b"\xce"
_BASIC_PUBLISH = struct.pack(">HH", 60, 40)


_BASIC_ACK = struct.pack(">HH", 60, 80)


class _AlarmedBrokerRelay(Relay):
    """A relay in front of RabbitMQ whose alarm goes off right after the next confirm.

    Then, as RabbitMQ does, each connection is told Connection.Blocked
    (the confirmed one at once, a new one on its first publish) and nothing
    more passes on it, either way: the broker stops reading a blocked
    publisher.
    """

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self._armed = threading.Event()
        self._alarmed = threading.Event()
        self._clients: dict[socket.socket, socket.socket] = {}  # by their server side
        self._blocked: set[socket.socket] = set()

    def alarm_after_confirm(self) -> None:
        self._armed.set()

    def _block(self, server: socket.socket) -> None:
        with self._lock:
            if server in self._blocked:
                return
            self._blocked.add(server)
        self._clients[server].sendall(_BLOCKED)

    def _held(self, server: socket.socket) -> bool:
        return server in self._blocked or super()._held(server)

    def _pipe(self, source: socket.socket, sink: socket.socket, from_server: bool) -> None:
        if not from_server:
            self._clients[sink] = source
        super()._pipe(source, sink, from_server)

    def _pass_on(self, data: bytes, sink: socket.socket, from_server: bool) -> None:
        if from_server:
            if self._armed.is_set() and _BASIC_ACK in data:
                # In the confirm's read: pika takes the notice with it.
                self._alarmed.set()
                server = next(s for s, c in self._clients.items() if c is sink)
                with self._lock:
                    self._blocked.add(server)
                data += _BLOCKED
            super()._pass_on(data, sink, from_server)
            return
        if self._alarmed.is_set() and _BASIC_PUBLISH in data:
            self._block(sink)
        if sink not in self._blocked:
            super()._pass_on(data, sink, from_server)


# The first byte of an MQTT CONNACK (packet type 2).
_CONNACK = b"\x20"


def _timed_send(
    name: str,
    settings: dict[str, object],
    prepare: Callable[[ForwardConfig], object] | None = None,
    http: requests.Session | None = None,
) -> tuple[forwarding.Result, float]:
    """Send one forward and time it; ``prepare`` (say, building its client) runs untimed first.

    ``http``: the session an HTTP forward posts with.
    """
    [bus] = parse_forwards([{"name": name, "timeout_seconds": TIMEOUT, **settings}], "test")
    with ThreadPoolExecutor(1) as pool:
        if prepare is not None:
            pool.submit(prepare, bus).result(60)
        started = time.monotonic()
        # A hang is a failure, not a stuck test: the worker's lease would end.
        result = pool.submit(forwarding.send, http, name, bus, outgoing()).result(60)
        elapsed = time.monotonic() - started
        pool.submit(publishers.close_thread_connections).result(10)
    return result, elapsed


def _within_timeout(result: forwarding.Result, elapsed: float, says: str | None = None) -> None:
    assert (result.ok, result.retryable) == (False, True), result
    said = f"within {TIMEOUT:g} s" if says is None else says
    assert said in (result.error or ""), result.error
    # Before: about 0.9 + 1 timeouts (MQTT, JetStream: 3.8 s), or until the
    # relay closed (Redis, SQS: 3x the timeout); the margin is half a timeout.
    assert elapsed < 1.5 * TIMEOUT, f"the attempt took {elapsed:.1f} s, its timeout is {TIMEOUT} s"


def test_mqtt_forward_whose_connect_is_slow_and_puback_never_comes_ends_within_its_timeout():
    try:
        broker = mosquitto.broker()
    except Exception as exc:  # no Mosquitto on this machine
        pytest.skip(f"Mosquitto: {exc}")
    # The CONNACK comes at 90 % of the timeout; the PUBACK never does.
    with _LateHandshakeRelay(broker.port, late=0.9 * TIMEOUT, hold_after=_CONNACK) as relay:
        result, elapsed = _timed_send(
            "bus",
            {
                "url": f"mqtt://127.0.0.1:{relay.port}",
                "topic": f"fwd-{uuid.uuid4().hex[:8]}/events",
            },
        )
    _within_timeout(result, elapsed, says="PUBACK")


def test_nats_forward_whose_connect_is_slow_and_puback_never_comes_ends_within_its_timeout(
    jetstream,
):
    port = urlsplit(jetstream.url).port or 4222
    # The server's INFO comes at 90 % of the timeout; after its PONG (the
    # connect done) nothing it says passes: no PubAck.
    with _LateHandshakeRelay(port, late=0.9 * TIMEOUT, hold_after=b"PONG") as relay:
        result, elapsed = _timed_send(
            "stream",
            {
                "url": f"nats://127.0.0.1:{relay.port}",
                "subject": f"{jetstream.prefix}.slow",
            },
        )
    _within_timeout(result, elapsed)


def test_redis_forward_whose_server_trickles_its_answers_ends_within_its_timeout():
    try:
        socket.create_connection(("127.0.0.1", 6379), timeout=1).close()
    except OSError as exc:
        pytest.skip(f"no Redis on 127.0.0.1:6379: {exc}")
    with _TricklingRelay(6379, gap=0.6 * TIMEOUT, lasts=3 * TIMEOUT) as relay:
        result, elapsed = _timed_send(
            "stream",
            {
                "url": f"redis://127.0.0.1:{relay.port}/0",
                "stream": f"fwd-{uuid.uuid4().hex[:8]}",
            },
        )
    _within_timeout(result, elapsed)


def test_rediss_forward_whose_connect_is_slow_and_tls_handshake_unanswered_ends_in_its_timeout():
    # The connect takes about half the timeout; the handshake, whose reads
    # the socket timeout bounded alone, took a whole timeout more (3 s).
    with _SlowSilentListener() as listener:
        result, elapsed = _timed_send(
            "stream",
            {"url": f"rediss://127.0.0.1:{listener.port}/0", "stream": "never"},
        )
    _within_timeout(result, elapsed)
    assert elapsed < TIMEOUT + 0.5, f"the attempt took {elapsed:.1f} s, its timeout is {TIMEOUT} s"


def test_sqs_forward_whose_server_trickles_its_answer_ends_within_its_timeout(
    sqs_queue,  # noqa: F811
):
    endpoint = sqs_queue.endpoint
    with _TricklingRelay(
        int(endpoint.rsplit(":", 1)[1]), gap=0.6 * TIMEOUT, lasts=3 * TIMEOUT
    ) as relay:
        path = sqs_queue.url.removeprefix(endpoint)
        result, elapsed = _timed_send(
            "queue",
            {
                "url": f"sqs://sqs.eu-west-1.amazonaws.com{path}",
                "region": "eu-west-1",
                "endpoint_url": f"http://127.0.0.1:{relay.port}",
            },
            # Building a boto3 client reads and parses the service's model,
            # local work the deadline does not bound; on a loaded machine it
            # took over 2 s, counted here as the attempt's before.
            prepare=publishers.sqs._client,
        )
    _within_timeout(result, elapsed)


def test_pubsub_forward_that_timed_out_sends_no_late_copy(
    pubsub_subscription,  # noqa: F811
    monkeypatch,
):
    from webhook_receiver.processing.publishers import pubsub

    emulator = os.environ["PUBSUB_EMULATOR_HOST"]
    # Not the test's monkeypatch: its undoing comes after the fixture's
    # teardown, which must reach the emulator itself.
    with _StalledRelay(int(emulator.rsplit(":", 1)[1])) as relay, monkeypatch.context() as patch:
        # A publisher client of this test's own, through the relay.
        patch.setenv("PUBSUB_EMULATOR_HOST", f"127.0.0.1:{relay.port}")
        patch.setattr(pubsub, "_clients", [])
        try:
            result, elapsed = _timed_send(
                "topic", {"url": f"pubsub://{PROJECT}/{pubsub_subscription.name}"}
            )
            # The path comes back once the attempt has failed: the client's
            # publish (60 s a call, retried for 600 s by default) went on and
            # sent a copy then.
            relay.release()
            time.sleep(3)
        finally:
            for client in pubsub._clients:
                client.stop()
    copies = pubsub_subscription.unacknowledged()
    assert copies == 0, "the timed-out publish was sent after its attempt had failed"
    _within_timeout(result, elapsed)


def test_amqp_forward_on_a_blocked_connection_then_a_blocked_fresh_one_ends_within_its_timeout(
    amqp_queue,  # noqa: F811
):
    port = urlsplit(amqp_queue.url).port or 5672
    url = amqp_queue.url.replace(f":{port}/", ":{}/")
    with _AlarmedBrokerRelay(port) as relay:
        [bus] = parse_forwards(
            [
                {
                    "name": "bus",
                    "timeout_seconds": TIMEOUT,
                    "url": url.format(relay.port),
                    "exchange": "",
                    "routing_key": amqp_queue.name,
                }
            ],
            "test",
        )
        with ThreadPoolExecutor(1) as pool:  # one thread: the connection it keeps
            try:
                # The alarm goes off as the first publish is confirmed: pika
                # reads the notice with the confirm, and its blocked-connection
                # timer (timeout_seconds) ends that connection in the next
                # attempt, which opens a fresh one, blocked again on its publish.
                relay.alarm_after_confirm()
                first = pool.submit(forwarding.send, None, "bus", bus, outgoing()).result(60)
                assert first.ok, first
                time.sleep(0.5 * TIMEOUT)
                started = time.monotonic()
                result = pool.submit(forwarding.send, None, "bus", bus, outgoing()).result(60)
                elapsed = time.monotonic() - started
            finally:
                pool.submit(publishers.close_thread_connections).result(10)
    _within_timeout(result, elapsed)
    # Before the attempt had one deadline: 3.1 s (the fresh connection had
    # a whole timeout of its own after pika's blocked-connection timer).
    assert elapsed < TIMEOUT + 0.5, f"the attempt took {elapsed:.1f} s, its timeout is {TIMEOUT} s"


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        return int(listener.getsockname()[1])


@pytest.mark.parametrize(
    "held, query",
    [
        # Each connect held to pika's socket and stack timeouts (which it
        # gave each try in full), 2 s apart (its default retry_delay).
        (True, "connection_attempts=3"),
        # Each connect refused at once, 5 s apart.
        (False, "connection_attempts=3&retry_delay=5"),
    ],
    ids=["connects-held", "connects-refused"],
)
def test_amqp_forward_whose_connect_is_tried_again_ends_within_its_timeout(held, query):
    # localhost: on a machine where it resolves to ::1 and 127.0.0.1, pika
    # tried each address with a whole timeout too (the listeners hold both).
    with _HeldListeners() as listeners:
        port = listeners.port if held else _free_port()
        result, elapsed = _timed_send(
            "bus",
            {
                "url": f"amqp://guest:guest@localhost:{port}/%2F?{query}",
                "exchange": "",
                "routing_key": "never",
            },
        )
    assert (result.ok, result.retryable) == (False, True), result
    # Before: 10.0 s (held: three 2 s tries, 2 s apart) and 10.0 s (refused:
    # three tries, 5 s apart).
    assert elapsed < TIMEOUT + 0.5, f"the attempt took {elapsed:.1f} s, its timeout is {TIMEOUT} s"


def _certificate(tmp_path: Path, name: str) -> tuple[Path, ssl.SSLContext]:
    """A self-signed certificate for ``name`` alone (no address), and a server context with it."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}"]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return cert, context


# What an AMQP 0-9-1 client sends first, once its transport is up.
_AMQP_HEADER = b"AMQP\x00\x00\x09\x01"


def test_amqps_forward_verifies_the_broker_by_its_name_within_its_timeout(tmp_path):
    # The connect goes to an address the name resolves to; the certificate
    # is still checked against the name (a certificate for localhost only).
    cert, context = _certificate(tmp_path, "localhost")
    received: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve() -> None:
            # The TLS handshake, then the client's first bytes; no answer.
            sock, _ = listener.accept()
            try:
                with context.wrap_socket(sock, server_side=True) as tls:
                    received.append(tls.recv(len(_AMQP_HEADER)))
                    tls.recv(1)  # until the client gives up
            except OSError:
                pass

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        port = listener.getsockname()[1]
        options = quote(repr({"cafile": str(cert)}))
        result, elapsed = _timed_send(
            "bus",
            {
                "url": f"amqps://guest:guest@localhost:{port}/%2F?ssl_options={options}",
                "exchange": "",
                "routing_key": "never",
            },
        )
        server.join(10)
    assert received == [_AMQP_HEADER], result.error
    assert (result.ok, result.retryable) == (False, True), result
    assert elapsed < TIMEOUT + 0.5, f"the attempt took {elapsed:.1f} s, its timeout is {TIMEOUT} s"


# Names only the stand-in resolver knows (no DNS server here, /etc/hosts
# untouched); it answers each with 127.0.0.1, SLOW_NAME as late as the
# test says, OTHER_NAME at once.
SLOW_NAME = "slow-dns.test"
OTHER_NAME = "other-dns.test"
# A resolver this late: the attempt waited for it, then connected and sent.
TOO_LATE = 3 * TIMEOUT
UNRESOLVED = f"{SLOW_NAME} did not resolve within {TIMEOUT:g} s"


@pytest.fixture
def slow_dns(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """``slow_dns(seconds)``: socket.getaddrinfo answers SLOW_NAME after ``seconds``.

    Only the resolver is stood in for; the servers connected to are real.
    A lookup still sleeping when the test ends finishes in its thread.
    """
    real = socket.getaddrinfo
    late = [0.0]

    def getaddrinfo(host: Any, port: Any, family: int = 0, type: int = 0, *rest: Any) -> Any:
        if host in (SLOW_NAME, OTHER_NAME):
            if host == SLOW_NAME:
                time.sleep(late[0])
            return real("127.0.0.1", port, socket.AF_INET, type, *rest)
        return real(host, port, family, type, *rest)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return lambda seconds: late.__setitem__(0, seconds)


def test_http_forward_whose_name_resolves_too_late_ends_within_its_timeout(slow_dns, downstream):
    slow_dns(TOO_LATE)
    port = urlsplit(downstream.url).port
    result, elapsed = _timed_send(
        "hooks", {"url": f"http://{SLOW_NAME}:{port}/hooks"}, http=requests.Session()
    )
    # Before: 6.0 s, and the event delivered then, past the lease.
    _within_timeout(result, elapsed, says=UNRESOLVED)
    assert result.error is not None and result.error.startswith("timeout: "), result.error
    assert downstream.calls_to("/hooks") == []


def test_http_forward_whose_name_resolves_late_connects_in_the_time_left(slow_dns):
    slow_dns(0.75 * TIMEOUT)
    with _HeldListeners() as listeners:
        result, elapsed = _timed_send(
            "hooks",
            {"url": f"http://{SLOW_NAME}:{listeners.port}/hooks"},
            http=requests.Session(),
        )
    # Before: 3.5 s (the connect after the resolver had a whole timeout).
    _within_timeout(result, elapsed, says="timed out")


def test_https_forward_resolved_first_verifies_the_target_by_its_name(
    slow_dns, tmp_path, monkeypatch
):
    # The certificate names the host only, no address: the connect goes to
    # 127.0.0.1, the TLS check (and SNI, and Host) is still for the name.
    cert, context = _certificate(tmp_path, SLOW_NAME)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    slow_dns(0.25 * TIMEOUT)
    server = Downstream()
    server.server.socket = context.wrap_socket(server.server.socket, server_side=True)
    server.start()
    try:
        port = server.server.server_address[1]
        result, elapsed = _timed_send(
            "hooks", {"url": f"https://{SLOW_NAME}:{port}/hooks"}, http=requests.Session()
        )
        # A name the certificate does not hold is refused: the check is on.
        other, _ = _timed_send(
            "hooks", {"url": f"https://{OTHER_NAME}:{port}/hooks"}, http=requests.Session()
        )
    finally:
        server.close()
    assert result.ok, result
    assert elapsed < TIMEOUT, f"the attempt took {elapsed:.1f} s, its timeout is {TIMEOUT} s"
    [call] = server.calls_to("/hooks")
    assert call.headers["Host"] == f"{SLOW_NAME}:{port}"
    assert (other.ok, other.retryable) == (False, True), other
    assert "CERTIFICATE_VERIFY_FAILED" in (other.error or ""), other.error


def _redis_or_skip() -> None:
    try:
        socket.create_connection(("127.0.0.1", 6379), timeout=1).close()
    except OSError as exc:
        pytest.skip(f"no Redis on 127.0.0.1:6379: {exc}")


def test_redis_forward_whose_name_resolves_too_late_ends_within_its_timeout(slow_dns):
    _redis_or_skip()
    slow_dns(TOO_LATE)
    stream = f"fwd-{uuid.uuid4().hex[:8]}"
    result, elapsed = _timed_send(
        "stream", {"url": f"redis://{SLOW_NAME}:6379/0", "stream": stream}
    )
    # Before: 6.0 s, and the entry added then.
    _within_timeout(result, elapsed, says=UNRESOLVED)


def test_redis_forward_whose_name_resolves_late_connects_in_the_time_left(slow_dns):
    slow_dns(0.75 * TIMEOUT)
    with _HeldListeners() as listeners:
        result, elapsed = _timed_send(
            "stream", {"url": f"redis://{SLOW_NAME}:{listeners.port}/0", "stream": "never"}
        )
    # Before: 3.5 s (the connect after the resolver had a whole timeout).
    _within_timeout(result, elapsed)


class _TlsRelay(Relay):
    """A relay that ends TLS (``context``'s certificate) in front of a plain server."""

    def __init__(self, port: int, context: ssl.SSLContext) -> None:
        self._context = context
        super().__init__(port)

    def _accept(self) -> None:
        while True:
            try:
                plain, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                client = self._context.wrap_socket(plain, server_side=True)
                server = socket.create_connection(("127.0.0.1", self._target))
            except OSError:
                plain.close()  # a client that refused the certificate, or the server away
                continue
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()


def test_rediss_forward_resolved_first_verifies_the_server_by_its_name(slow_dns, tmp_path):
    _redis_or_skip()
    cert, context = _certificate(tmp_path, SLOW_NAME)
    slow_dns(0.25 * TIMEOUT)
    stream = f"fwd-{uuid.uuid4().hex[:8]}"
    with _TlsRelay(6379, context) as relay:
        urls = [
            f"rediss://{name}:{relay.port}/0?ssl_ca_certs={quote(str(cert))}"
            for name in (SLOW_NAME, OTHER_NAME)
        ]
        result, elapsed = _timed_send("stream", {"url": urls[0], "stream": stream})
        # A name the certificate does not hold is refused: the check is on.
        other, _ = _timed_send("stream", {"url": urls[1], "stream": stream})
    assert result.ok, result
    assert elapsed < TIMEOUT, f"the attempt took {elapsed:.1f} s, its timeout is {TIMEOUT} s"
    assert (other.ok, other.retryable) == (False, True), other
    assert "CERTIFICATE_VERIFY_FAILED" in (other.error or ""), other.error


def test_sqs_forward_whose_name_resolves_too_late_ends_within_its_timeout(
    slow_dns,
    sqs_queue,  # noqa: F811
):
    slow_dns(TOO_LATE)
    endpoint = sqs_queue.endpoint
    port = int(endpoint.rsplit(":", 1)[1])
    path = sqs_queue.url.removeprefix(endpoint)
    result, elapsed = _timed_send(
        "queue",
        {
            "url": f"sqs://sqs.eu-west-1.amazonaws.com{path}",
            "region": "eu-west-1",
            "endpoint_url": f"http://{SLOW_NAME}:{port}",
        },
        prepare=publishers.sqs._client,
    )
    # Before: 6.0 s, and the message sent then.
    _within_timeout(result, elapsed, says=UNRESOLVED)


def test_amqp_forward_whose_name_resolves_too_late_ends_within_its_timeout(
    slow_dns,
    rabbit_url,  # noqa: F811
):
    slow_dns(TOO_LATE)
    port = urlsplit(rabbit_url).port or 5672
    result, elapsed = _timed_send(
        "bus",
        {
            "url": f"amqp://guest:guest@{SLOW_NAME}:{port}/%2F",
            "exchange": "",
            "routing_key": "never",
        },
    )
    # Before: 6.0 s (then unroutable, the broker reached).
    _within_timeout(result, elapsed, says=UNRESOLVED)


def test_mqtt_forward_whose_name_resolves_too_late_ends_within_its_timeout(slow_dns):
    # paho resolves in its network thread, which the attempt waits for
    # with the time it has left: bounded as it was, kept so.
    try:
        broker = mosquitto.broker()
    except Exception as exc:  # no Mosquitto on this machine
        pytest.skip(f"Mosquitto: {exc}")
    slow_dns(TOO_LATE)
    url = f"mqtt://{SLOW_NAME}:{broker.port}"
    try:
        result, elapsed = _timed_send("bus", {"url": url, "topic": "fwd-never/events"})
    finally:
        held = publishers.mqtt._publishers.get(url)
        if held is not None:
            publishers.mqtt._drop(held)
    _within_timeout(result, elapsed, says="not connected")


def test_nats_forward_whose_name_resolves_too_late_ends_within_its_timeout(slow_dns, jetstream):
    # nats-py resolves in the event loop's executor, which the attempt's
    # wait_for stops waiting for: bounded as it was, kept so.
    slow_dns(TOO_LATE)
    port = urlsplit(jetstream.url).port or 4222
    result, elapsed = _timed_send(
        "stream", {"url": f"nats://{SLOW_NAME}:{port}", "subject": f"{jetstream.prefix}.never"}
    )
    _within_timeout(result, elapsed)


def test_resolutions_left_behind_by_a_resolver_that_never_answers_are_bounded(
    slow_dns, monkeypatch
):
    slow_dns(TOO_LATE)
    monkeypatch.setattr(deadline, "_resolving", threading.BoundedSemaphore(2))
    before = set(threading.enumerate())
    for _ in range(3):
        started = time.monotonic()
        with pytest.raises(deadline.NameNotResolved, match=f"{SLOW_NAME} did not resolve within"):
            deadline.resolve(SLOW_NAME, 80, by=started + 0.2, within=0.2)
        assert time.monotonic() - started < 0.5
    # The third found both slots taken and started no thread of its own.
    left = [t for t in set(threading.enumerate()) - before if SLOW_NAME in t.name]
    assert len(left) == 2, left
