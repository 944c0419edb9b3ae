"""Slow clients against the documented deployment: nginx (deploy/nginx/) in front of gunicorn.

Two sync workers serve one connection each. Straight on gunicorn, two
sockets that send their headers and then dribble (or withhold) the body hold
both workers until gunicorn's 30 s timeout, and /healthz does not answer
meanwhile. Through nginx, which reads every request whole (with its own read
timeouts) before it passes it on, the workers never see them: here ten such
clients, five times the workers, stay connected while the probes answer and
a delivery is stored and acknowledged.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
import requests

from bench.front import nginx

from .conftest import ACME_TOKEN
from .helpers import count_at
from .helpers import signing as s
from .servers import gunicorn

pytestmark = pytest.mark.slow

WORKERS = 2
SLOW_CLIENTS = 10  # at least 4 times the workers
CONFIG = f"""
[sources.stripe-live]
provider = "stripe"
secrets = ["{s.STRIPE_SECRET}"]

[clients.acme]
token = "{ACME_TOKEN}"
"""


@pytest.fixture
def front(db_url, tmp_path) -> Iterator[str]:
    """The base URL of nginx, in front of gunicorn with two sync workers."""
    env = {"WEBHOOK_RECEIVER_TRUSTED_PROXIES": "1"}
    with (
        gunicorn(db_url, CONFIG, tmp_path, workers=WORKERS, env=env) as server,
        nginx(server.url, tmp_path / "nginx") as running,
    ):
        yield running.url


def slow_client(url: str, n: int) -> socket.socket:
    """A connection that sent its headers and part of its body, and then nothing more."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = "POST /webhooks/stripe-live HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if n % 2:  # Content-Length: 100, and 6 bytes of it
        sock.sendall(f"{head}Content-Length: 100\r\n\r\n".encode() + b'{"id":')
    else:  # chunked, stopped in the middle of a chunk-size line
        sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + b"6")
    return sock


def test_probes_and_deliveries_are_served_while_slow_clients_dribble(front, db_url) -> None:
    with ExitStack() as stack:
        for n in range(SLOW_CLIENTS):
            stack.enter_context(slow_client(front, n))
        # Every slow socket is open and waiting in nginx: the workers are free.
        assert requests.get(front + "/healthz", timeout=10).status_code == 200
        assert requests.get(front + "/readyz", timeout=10).status_code == 200
        body, headers = s.stripe_delivery({"id": "evt_while_slow", "type": "invoice.paid"})
        first = requests.post(
            front + "/webhooks/stripe-live", data=body, headers=headers, timeout=10
        )
        assert first.status_code == 200, first.text
        again = requests.post(
            front + "/webhooks/stripe-live", data=body, headers=headers, timeout=10
        )
        assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
        assert again.json() == first.json()
    assert count_at(db_url) == 1


def test_a_chunked_delivery_arrives_whole_through_the_front(front, db_url) -> None:
    # nginx reads the chunks, then hands gunicorn a body with its length.
    body, headers = s.stripe_delivery({"id": "evt_chunked", "type": "invoice.paid"})
    pieces = iter([body[:7], body[7:]])
    response = requests.post(
        front + "/webhooks/stripe-live", data=pieces, headers=headers, timeout=10
    )
    assert response.status_code == 200, response.text
    assert count_at(db_url) == 1


def test_an_oversized_body_is_refused_by_the_app_in_problem_json(front) -> None:
    # nginx's own limit is above the app's, so the 413 is the app's problem+json.
    body = b'{"id":"' + b"x" * (1024 * 1024 + 10) + b'"}'
    response = requests.post(
        front + "/webhooks/stripe-live",
        data=body,
        headers={"Content-Type": "application/json", "Stripe-Signature": "t=1,v1=00"},
        timeout=10,
    )
    assert response.status_code == 413
    assert response.headers["Content-Type"] == "application/problem+json"
