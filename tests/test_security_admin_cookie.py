"""The admin's session cookie is Secure whenever the admin is reached over HTTPS.

``SESSION_COOKIE_SECURE`` defaulted to off and was the only thing that set
the flag: an admin served over HTTPS (a TLS proxy in front, its
X-Forwarded-Proto trusted) by an operator who had not also set it handed
out a cookie the browser would send over plain HTTP too, where anyone on
the path who can make the browser ask http://<host>/admin/ reads it.
"""

from __future__ import annotations

import re

from flask import Flask

from .admin.conftest import PASSWORD

_TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')


def _session_cookies(response) -> list[str]:
    return [c for c in response.headers.getlist("Set-Cookie") if c.startswith("session=")]


def _log_in(app: Flask, base_url: str, origin: str | None = None, **environ: str):
    client = app.test_client()
    page = client.get("/admin/login", base_url=base_url, headers=environ)
    token = _TOKEN.search(page.get_data(as_text=True)).group(1)
    response = client.post(
        "/admin/login",
        data={"password": PASSWORD, "csrf_token": token},
        base_url=base_url,
        headers={"Referer": f"{origin or base_url}/admin/login", **environ},
    )
    assert response.status_code == 302, response.get_data(as_text=True)
    return page, response, client


def test_over_https_the_cookie_is_secure_without_the_setting(make_app) -> None:
    app = make_app(ADMIN_PASSWORD=PASSWORD)
    page, response, client = _log_in(app, "https://localhost")
    for cookie in _session_cookies(page) + _session_cookies(response):
        assert "; Secure" in cookie, cookie
    assert client.get("/admin/", base_url="https://localhost").status_code == 200


def test_behind_a_trusted_tls_proxy_the_cookie_is_secure(make_app) -> None:
    app = make_app(ADMIN_PASSWORD=PASSWORD, TRUSTED_PROXIES=1)
    _, response, _ = _log_in(
        app, "http://localhost", "https://localhost", **{"X-Forwarded-Proto": "https"}
    )
    assert all("; Secure" in c for c in _session_cookies(response))
    assert _session_cookies(response)


def test_over_plain_http_the_cookie_still_works(make_app) -> None:
    # Without TLS (a laptop, a test) a Secure cookie would never come back.
    app = make_app(ADMIN_PASSWORD=PASSWORD)
    _, response, client = _log_in(app, "http://localhost")
    assert _session_cookies(response)
    assert not any("Secure" in c for c in _session_cookies(response))
    assert client.get("/admin/").status_code == 200
