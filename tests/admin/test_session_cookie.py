"""The admin's session cookie is scoped to /admin: set, replaced and cleared there.

With ``Path=/`` a browser sent it with every webhook and API request to the
host, and to any other app served there under another path. A cleared
cookie must carry the same path, or the browser keeps the old one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import requests
from flask import Flask
from flask.testing import FlaskClient

from ..conftest import ACME_TOKEN
from ..servers import gunicorn
from .conftest import PASSWORD, csrf_token, login

EXPIRED = "Expires=Thu, 01 Jan 1970 00:00:00 GMT"


def session_cookies(response) -> list[str]:
    return [c for c in response.headers.getlist("Set-Cookie") if c.startswith("session=")]


def scoped(response) -> list[str]:
    """The response's session cookies at /admin; each carries the usual flags."""
    found = [c for c in session_cookies(response) if "; Path=/admin" in c]
    for cookie in found:
        assert "HttpOnly" in cookie and "SameSite=Lax" in cookie, cookie
    return found


def sent_cookie(response) -> str:
    """The Cookie header the client sent with the request that got ``response``."""
    return response.request.environ.get("HTTP_COOKIE", "")


def test_the_session_cookie_is_set_for_the_admin_path_only(anon: FlaskClient):
    form = anon.get("/admin/login")  # the CSRF token starts the session
    assert len(scoped(form)) == 1
    # Any other session cookie is an expiry (of one left at the root before).
    assert all(EXPIRED in c for c in session_cookies(form) if "; Path=/admin" not in c)
    response = login(anon)
    assert response.status_code == 302
    assert len(scoped(response)) == 1
    assert EXPIRED not in scoped(response)[0]
    assert anon.get_cookie("session", path="/admin") is not None
    assert anon.get_cookie("session") is None  # nothing at Path=/
    assert anon.get("/admin/").status_code == 200
    assert "session=" in sent_cookie(anon.get("/admin/events"))
    # Not sent outside the admin: webhooks, the API, probes.
    for path in ("/healthz", "/api/events", "/webhooks/stripe", "/administrator"):
        assert "session=" not in sent_cookie(anon.get(path)), path


@pytest.mark.parametrize("everywhere", [False, True], ids=["logout", "everywhere"])
def test_logging_out_clears_the_cookie_at_the_admin_path(anon: FlaskClient, everywhere):
    login(anon)
    form = {"csrf_token": csrf_token(anon, "/admin/")}
    if everywhere:
        form["everywhere"] = "yes"
    before = anon.get_cookie("session", path="/admin").value
    response = anon.post("/admin/logout", data=form)
    assert response.status_code == 302
    # The logged-out session (its flash message alone) replaces the cookie
    # at /admin: the same cookie, not a second one beside it that the
    # browser would send along with the old.
    assert len(scoped(response)) == 1
    after = anon.get_cookie("session", path="/admin")
    assert after is not None and after.value != before
    assert anon.get_cookie("session") is None
    with anon.session_transaction("/admin/") as session:
        assert "admin" not in session
    assert anon.get("/admin/").status_code == 302
    assert "You are logged out" in anon.get("/admin/login").get_data(as_text=True)


def test_a_cookie_set_at_the_root_before_is_expired_at_the_next_write(admin_app: Flask):
    # A browser logged in before the cookie was scoped holds it at Path=/;
    # the new one at /admin is another cookie, so the old one must be
    # expired explicitly, or it is sent to every URL of the host.
    first = admin_app.test_client()
    login(first)
    value = first.get_cookie("session", path="/admin").value
    browser = admin_app.test_client()
    browser.set_cookie("session", value, path="/")
    assert browser.get("/admin/").status_code == 200
    response = browser.post("/admin/logout", data={"csrf_token": csrf_token(browser, "/admin/")})
    assert response.status_code == 302
    root = [c for c in session_cookies(response) if "; Path=/;" in c or c.endswith("; Path=/")]
    assert len(root) == 1 and EXPIRED in root[0], session_cookies(response)
    assert browser.get_cookie("session") is None
    assert "session=" not in sent_cookie(browser.get("/healthz"))
    assert browser.get("/admin/").status_code == 302


@pytest.mark.slow
def test_over_real_http_the_cookie_stays_under_admin_and_logout_clears_it(db_url, tmp_path: Path):
    config = f'[clients.acme]\ntoken = "{ACME_TOKEN}"\n'
    env = {"WEBHOOK_RECEIVER_ADMIN_PASSWORD": PASSWORD}
    token = re.compile(r'name="csrf_token" value="([^"]+)"')
    with gunicorn(db_url, config, tmp_path, workers=1, env=env) as server:
        browser = requests.Session()
        page = browser.get(f"{server.url}/admin/login")
        logged_in = browser.post(
            f"{server.url}/admin/login",
            data={"password": PASSWORD, "csrf_token": token.search(page.text).group(1)},
            allow_redirects=False,
        )
        assert logged_in.status_code == 302
        header = logged_in.headers["Set-Cookie"]
        assert "Path=/admin" in header and "HttpOnly" in header and "SameSite=Lax" in header
        assert [(c.name, c.path) for c in browser.cookies] == [("session", "/admin")]
        assert browser.get(f"{server.url}/admin/", allow_redirects=False).status_code == 200
        # requests, as a browser, sends it only under /admin.
        api = browser.post(f"{server.url}/api/events", json={}, allow_redirects=False)
        assert "Cookie" not in api.request.headers
        assert "Cookie" in browser.get(f"{server.url}/admin/").request.headers

        page = browser.get(f"{server.url}/admin/")
        out = browser.post(
            f"{server.url}/admin/logout",
            data={"csrf_token": token.search(page.text).group(1), "everywhere": "yes"},
            allow_redirects=False,
        )
        assert out.status_code == 302
        assert "Path=/admin" in out.headers["Set-Cookie"]
        # Replaced where it was set: one cookie, the logged-out one.
        assert [(c.name, c.path) for c in browser.cookies] == [("session", "/admin")]
        assert browser.cookies["session"] != logged_in.cookies["session"]
        assert browser.get(f"{server.url}/admin/", allow_redirects=False).status_code == 302
        assert "You are logged out" in browser.get(f"{server.url}/admin/login").text


def test_under_a_script_root_the_cookie_is_scoped_below_it(anon: FlaskClient):
    # Mounted at /hooks (SCRIPT_NAME), the admin is /hooks/admin, and so is its cookie.
    form = anon.get("/admin/login", base_url="http://localhost/hooks/")
    assert form.status_code == 200
    (cookie,) = [c for c in session_cookies(form) if EXPIRED not in c]
    assert "; Path=/hooks/admin;" in cookie
