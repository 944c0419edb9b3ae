"""Who gets in: the password, the session, the throttle, and the admin switched off."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from flask import Flask
from sqlalchemy import select

from webhook_receiver.extensions import db
from webhook_receiver.models import AdminLoginFailure, Delivery, utcnow

from ..helpers import count
from .conftest import PASSWORD, add, csrf_token, delivery, event, login, post, text

PAGES = [
    "/admin/",
    "/admin/events",
    "/admin/events/1",
    "/admin/conflicts",
    "/admin/conflicts/1",
    "/admin/dead",
    "/admin/idempotency",
    "/admin/rejections",
    "/admin",
]


@pytest.mark.parametrize("password", [None, ""])
def test_admin_without_password_is_404_everywhere(make_app, password):
    app = make_app(ADMIN_PASSWORD=password)
    client = app.test_client()
    for url in [*PAGES, "/admin/login", "/admin", "/admin/static/admin.css", "/admin/nope"]:
        response = client.get(url)
        assert response.status_code == 404, url
        assert "webhook-receiver" not in text(response)
    # Not even a 405 or a redirect gives it away.
    for url in ["/admin/login", "/admin/logout", "/admin/deliveries/requeue", "/admin/events"]:
        assert client.post(url, data={"password": ""}).status_code == 404, url
    assert client.get("/admin/logout").status_code == 404
    assert client.get("/admin/events/").status_code == 404


def test_password_from_the_environment(make_app, monkeypatch):
    monkeypatch.setenv("WEBHOOK_RECEIVER_ADMIN_PASSWORD", "from-the-env-password")
    app = make_app()
    client = app.test_client()
    assert client.get("/admin/login").status_code == 200
    assert login(client, "from-the-env-password").status_code == 302


@pytest.mark.parametrize("url", PAGES)
def test_pages_require_login(anon, url):
    response = anon.get(url)
    assert response.status_code == 302
    assert response.headers["Location"].startswith("/admin/login?next=")


def test_login_form_then_back_to_the_page_asked_for(anon, admin_app):
    event_id = event(admin_app)
    response = anon.get(f"/admin/events/{event_id}?x=1")
    assert response.status_code == 302
    page = anon.get(response.headers["Location"])
    assert page.status_code == 200
    assert 'name="password"' in text(page)
    assert f'value="/admin/events/{event_id}?x=1"' in text(page)
    done = login(anon, next=f"/admin/events/{event_id}?x=1")
    assert done.status_code == 302
    assert done.headers["Location"] == f"/admin/events/{event_id}?x=1"
    assert anon.get(f"/admin/events/{event_id}").status_code == 200


@pytest.mark.parametrize(
    "target",
    [
        "https://evil.example/",
        "//evil.example/admin/",
        "/\\evil.example",
        "/api/events",
        "x",
        # Browsers resolve dot segments, written plainly or percent-encoded.
        "/admin/../api/events",
        "/admin/%2e%2e/api/events",
        "/admin/.%2E/metrics",
        "/admin/events/../../api/events",
    ],
)
def test_login_never_redirects_outside_the_admin(anon, target):
    response = login(anon, next=target)
    assert response.status_code == 302
    assert response.headers["Location"] == "/admin/"


def test_wrong_password_is_refused(anon, admin_app):
    response = login(anon, "not the password")
    assert response.status_code == 200
    assert "Wrong password." in text(response)
    assert anon.get("/admin/").status_code == 302
    assert count(admin_app, AdminLoginFailure) == 1


def test_an_empty_password_is_refused(anon):
    assert "Wrong password." in text(login(anon, ""))
    assert anon.get("/admin/events").status_code == 302


def test_good_login_opens_a_session_with_safe_cookie_flags(anon):
    response = login(anon)
    assert response.status_code == 302
    cookie = response.headers["Set-Cookie"]
    assert "HttpOnly" in cookie
    assert "SameSite=Lax" in cookie
    assert "Secure" not in cookie
    assert anon.get("/admin/").status_code == 200


def test_session_cookie_is_secure_when_configured(make_app):
    app = make_app(ADMIN_PASSWORD=PASSWORD, SESSION_COOKIE_SECURE=True)
    client = app.test_client()
    https = "https://localhost"
    page = client.get("/admin/login", base_url=https)
    assert "Secure" in page.headers["Set-Cookie"]
    token = re.search(r'name="csrf_token" value="([^"]+)"', text(page)).group(1)
    response = client.post(
        "/admin/login",
        data={"password": PASSWORD, "csrf_token": token},
        base_url=https,
        headers={"Referer": f"{https}/admin/login"},
    )
    assert response.status_code == 302
    assert "Secure" in response.headers["Set-Cookie"]
    assert client.get("/admin/", base_url=https).status_code == 200


def test_logout_ends_the_session(admin):
    response = post(admin, "/admin/logout")
    assert response.status_code == 302
    assert response.headers["Location"] == "/admin/login"
    assert admin.get("/admin/").status_code == 302


def test_logout_is_not_a_get(admin):
    assert admin.get("/admin/logout").status_code == 405
    assert admin.get("/admin/").status_code == 200


def test_changing_the_password_ends_open_sessions(make_app, admin):
    cookie = admin.get_cookie("session", path="/admin")
    other = make_app(ADMIN_PASSWORD="a different password").test_client()
    other.set_cookie("session", cookie.value, path="/admin")
    assert other.get("/admin/").status_code == 302


def test_session_ends_after_its_lifetime(admin):
    with admin.session_transaction("/admin/") as session:
        data = dict(session["admin"])
        data["at"] -= 13 * 3600
        session["admin"] = data
    assert admin.get("/admin/").status_code == 302


def test_a_forged_session_value_is_not_a_login(anon):
    with anon.session_transaction("/admin/") as session:
        session["admin"] = {"tag": "0" * 64, "at": 2**31}
    assert anon.get("/admin/").status_code == 302


def test_failed_logins_are_throttled_per_address(anon, make_app, admin_app):
    for _ in range(5):
        assert login(anon, "guess").status_code == 200
    throttled = login(anon, "guess")
    assert throttled.status_code == 429
    assert int(throttled.headers["Retry-After"]) == 15 * 60
    assert "Too many failed logins" in text(throttled)
    # While throttled even the right password is not tried.
    assert login(anon, PASSWORD).status_code == 429
    assert anon.get("/admin/").status_code == 302
    # Another worker (another app on the same database) counts the same failures.
    other = make_app(ADMIN_PASSWORD=PASSWORD).test_client()
    assert login(other, PASSWORD).status_code == 429
    # Another address is not held back.
    elsewhere = admin_app.test_client()
    elsewhere.environ_base["REMOTE_ADDR"] = "198.51.100.7"
    assert login(elsewhere, PASSWORD).status_code == 302


def test_failed_logins_from_one_ipv6_network_count_together(admin_app):
    # Anyone given an IPv6 /64 (a home line, a cloud machine) holds 2**64
    # addresses: counted one by one, each new address had 5 fresh tries.
    client = admin_app.test_client()
    for n in range(1, 6):
        client.environ_base["REMOTE_ADDR"] = f"2001:db8:1:2::{n:x}"
        assert login(client, "guess").status_code == 200
    client.environ_base["REMOTE_ADDR"] = "2001:db8:1:2:ffff:ffff:ffff:ffff"
    assert login(client, PASSWORD).status_code == 429
    # Another /64 is another address.
    client.environ_base["REMOTE_ADDR"] = "2001:db8:1:3::1"
    assert login(client, PASSWORD).status_code == 302


def test_an_ipv4_address_counts_the_same_written_as_ipv6(admin_app):
    # A dual-stack listener shows an IPv4 client as ::ffff:a.b.c.d.
    client = admin_app.test_client()
    for n in range(5):
        client.environ_base["REMOTE_ADDR"] = "192.0.2.1" if n % 2 else "::ffff:192.0.2.1"
        assert login(client, "guess").status_code == 200
    client.environ_base["REMOTE_ADDR"] = "192.0.2.1"
    assert login(client, PASSWORD).status_code == 429


def test_old_failures_neither_count_nor_stay(anon, admin_app):
    old = utcnow() - timedelta(minutes=16)
    for _ in range(5):
        add(admin_app, AdminLoginFailure(remote_addr="127.0.0.1", at=old))
    add(admin_app, AdminLoginFailure(remote_addr="192.0.2.1", at=old - timedelta(days=1)))
    assert login(anon, "guess").status_code == 200  # not throttled: the old ones expired
    with admin_app.app_context():
        rows = db.session.execute(select(AdminLoginFailure.remote_addr)).scalars().all()
    assert rows == ["127.0.0.1"]  # pruned down to the new failure


def test_good_login_clears_the_address_failures(anon, admin_app):
    for _ in range(4):
        login(anon, "guess")
    assert login(anon).status_code == 302
    assert count(admin_app, AdminLoginFailure) == 0


def test_throttle_limits_are_configurable(make_app):
    app = make_app(ADMIN_PASSWORD=PASSWORD, ADMIN_LOGIN_MAX_FAILURES=2)
    client = app.test_client()
    login(client, "a")
    login(client, "b")
    assert login(client, PASSWORD).status_code == 429


@pytest.mark.parametrize("url", ["/admin/login", "/admin/", "/admin/events/999999", "/admin/nope"])
def test_security_headers_on_every_admin_response(admin, url):
    response = admin.get(url)
    csp = response.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp
    assert "script-src 'none'" in csp
    assert "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp
    assert response.headers["X-Frame-Options"] == "DENY"
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Referrer-Policy"] == "same-origin"
    assert response.headers["Cache-Control"] == "no-store"


def test_html_errors_not_problem_json(admin):
    response = admin.get("/admin/events/999999")
    assert response.status_code == 404
    assert response.mimetype == "text/html"
    assert "No such event." in text(response)


def test_stylesheet_is_served_before_login(anon):
    response = anon.get("/admin/static/admin.css")
    assert response.status_code == 200
    assert response.mimetype == "text/css"
    response.close()


def test_pages_hold_no_inline_script_or_style(admin, admin_app):
    event(admin_app)
    for url in PAGES[:3] + ["/admin/login"]:
        html = text(admin.get(url))
        assert "<script" not in html
        assert "style=" not in html
        assert "<style" not in html


def test_concurrent_wrong_passwords_get_at_most_the_limit_of_tries(admin_app: Flask) -> None:
    limit, guesses = admin_app.config["ADMIN_LOGIN_MAX_FAILURES"], 40
    clients = [admin_app.test_client() for _ in range(guesses)]
    tokens = [csrf_token(client, "/admin/login") for client in clients]
    start = threading.Barrier(guesses)

    def guess(n: int) -> int:
        start.wait()
        form = {"password": f"wrong-{n}", "csrf_token": tokens[n]}
        return clients[n].post("/admin/login", data=form).status_code

    with ThreadPoolExecutor(max_workers=guesses) as pool:
        statuses = list(pool.map(guess, range(guesses)))
    assert set(statuses) <= {200, 429}, statuses
    # 200 is the form again with "Wrong password.": a try that reached the check.
    assert statuses.count(200) <= limit, statuses
    assert statuses.count(429) >= guesses - limit
    # The right password from that address is throttled too, for the window.
    assert login(admin_app.test_client()).status_code == 429


def test_logout_revokes_a_copied_session_cookie(admin_app: Flask) -> None:
    event_id = event(admin_app)
    dead_id = delivery(admin_app, event_id, state="dead", attempts=8)
    browser = admin_app.test_client()
    assert login(browser).status_code == 302
    cookie = browser.get_cookie("session", path="/admin")
    assert cookie is not None
    thief = admin_app.test_client()
    thief.set_cookie("session", cookie.value, path="/admin")
    assert thief.get("/admin/").status_code == 200  # the copy works while the session is open
    token = csrf_token(thief, "/admin/")

    assert browser.post("/admin/logout", data={"csrf_token": csrf_token(browser, "/admin/")})
    assert browser.get("/admin/").status_code == 302

    # The copy, taken before the logout, opens nothing now: no page, no action.
    page = thief.get("/admin/")
    assert page.status_code == 302 and "/admin/login" in page.headers["Location"]
    requeue = thief.post("/admin/deliveries/requeue", data={"ids": dead_id, "csrf_token": token})
    assert requeue.status_code == 403
    with admin_app.app_context():
        assert db.session.get(Delivery, dead_id).state == "dead"


def test_a_new_login_after_logout_works_and_the_old_cookie_stays_dead(admin_app: Flask) -> None:
    client = admin_app.test_client()
    assert login(client).status_code == 302
    old = client.get_cookie("session", path="/admin").value
    client.post("/admin/logout", data={"csrf_token": csrf_token(client, "/admin/")})
    assert login(client).status_code == 302
    assert client.get("/admin/").status_code == 200
    stale = admin_app.test_client()
    stale.set_cookie("session", old, path="/admin")
    assert stale.get("/admin/").status_code == 302


def test_logging_in_again_ends_the_session_it_replaces(admin_app: Flask) -> None:
    # The login form posted from a live session (a second tab's form) opens
    # a new session: the one it replaces ends on the server, so a copy of
    # its cookie opens nothing afterwards.
    client = admin_app.test_client()
    assert login(client).status_code == 302
    old = client.get_cookie("session", path="/admin").value
    again = client.post(
        "/admin/login",
        data={"password": PASSWORD, "csrf_token": csrf_token(client, "/admin/")},
    )
    assert again.status_code == 302
    assert client.get_cookie("session", path="/admin").value != old
    assert client.get("/admin/").status_code == 200
    stale = admin_app.test_client()
    stale.set_cookie("session", old, path="/admin")
    assert stale.get("/admin/").status_code == 302


def test_logging_out_everywhere_ends_every_open_session(admin_app: Flask) -> None:
    # A cookie taken from another browser (a lost laptop, a shared machine)
    # could only be ended by its own logout, or by changing the password and
    # restarting every process. Any operator may now end every session.
    mine, elsewhere, stolen = (admin_app.test_client() for _ in range(3))
    assert login(mine).status_code == 302
    assert login(elsewhere).status_code == 302
    stolen.set_cookie(
        "session", elsewhere.get_cookie("session", path="/admin").value, path="/admin"
    )
    assert stolen.get("/admin/").status_code == 200
    page = text(mine.get("/admin/"))
    assert 'name="everywhere" value="yes"' in page
    response = mine.post(
        "/admin/logout", data={"csrf_token": csrf_token(mine, "/admin/"), "everywhere": "yes"}
    )
    assert response.status_code == 302
    assert "every session" in text(mine.get(response.headers["Location"]))
    for client in (mine, elsewhere, stolen):
        assert client.get("/admin/").status_code == 302
    # Logging in again works as ever.
    assert login(elsewhere).status_code == 302
    assert elsewhere.get("/admin/").status_code == 200
