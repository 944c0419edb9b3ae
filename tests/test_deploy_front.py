"""Headers a client sends that the front must not pass on as its own: nginx before gunicorn.

gunicorn believes the scheme headers (X-Forwarded-Proto, X-Forwarded-Ssl,
X-Forwarded-Protocol) from the addresses of ``forwarded_allow_ips``, which
by default is loopback, where nginx connects from. nginx sets
X-Forwarded-Proto; a client's X-Forwarded-Ssl or X-Forwarded-Protocol that
contradicts it made gunicorn refuse the request with its own plain-text 400.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from bench.front import nginx

from .servers import gunicorn

pytestmark = pytest.mark.slow


@pytest.fixture
def front(db_url, tmp_path) -> Iterator[str]:
    env = {"WEBHOOK_RECEIVER_TRUSTED_PROXIES": "1"}
    with (
        gunicorn(db_url, "", tmp_path, workers=1, env=env) as server,
        nginx(server.url, tmp_path / "nginx") as running,
    ):
        yield running.url


@pytest.mark.parametrize("header", [{"X-Forwarded-Ssl": "on"}, {"X-Forwarded-Protocol": "ssl"}])
def test_a_clients_scheme_header_is_not_passed_on(front, header):
    response = requests.get(f"{front}/healthz", headers=header, timeout=10)
    assert response.status_code == 200, response.text
