"""The body limit holds for bodies sent without Content-Length (chunked), not only with one."""

from __future__ import annotations

import pytest
import requests

from webhook_receiver.models import IdempotencyRecord

from .conftest import ACME_TOKEN, bearer
from .helpers import count_at
from .servers import gunicorn

LIMIT = 1000
HEADERS = {"Content-Type": "application/json", **bearer()}


def body_of(size: int) -> bytes:
    """A JSON event body of exactly ``size`` bytes."""
    head, tail = b'{"type":"t","data":"', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def chunks(data: bytes, size: int = 300):
    for i in range(0, len(data), size):
        yield data[i : i + size]


def stored(db_url: str) -> tuple[int, int]:
    """The number of events and of idempotency records."""
    return count_at(db_url), count_at(db_url, IdempotencyRecord)


@pytest.mark.slow
def test_chunked_bodies_under_gunicorn(db_url, tmp_path):
    config = f'[clients.acme]\ntoken = "{ACME_TOKEN}"\n'
    env = {"WEBHOOK_RECEIVER_MAX_BODY_BYTES": str(LIMIT)}
    with gunicorn(db_url, config, tmp_path, env=env) as server:

        def post(data, key: str) -> requests.Response:
            return requests.post(
                server.url + "/api/events",
                data=data,
                headers={**HEADERS, "Idempotency-Key": key},
                timeout=10,
            )

        # Werkzeug alone would cut this body at the limit and hand the view
        # the truncated part (a 400 here, stored and replayed for the key).
        over = post(chunks(body_of(LIMIT * 3)), "over")
        assert over.status_code == 413, over.text
        assert over.headers["Content-Type"] == "application/problem+json"
        assert stored(db_url) == (0, 0)
        # The same key with a body of exactly the limit executes: the 413 was not saved.
        assert post(chunks(body_of(LIMIT)), "over").status_code == 201
        assert post(body_of(LIMIT + 1), "with-length").status_code == 413
        for path in ("/webhooks/anything", "/api/nope"):
            response = requests.post(
                server.url + path, data=chunks(body_of(LIMIT * 2)), headers=HEADERS, timeout=10
            )
            assert response.status_code == 413, (path, response.status_code)
    assert stored(db_url) == (1, 1)
