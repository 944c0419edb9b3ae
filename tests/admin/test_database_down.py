"""The admin with its database away: an HTML 503 page, never problem+json, a 500 or another page."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import event as sa_event

from webhook_receiver.extensions import db

from ..servers import free_port
from .conftest import PASSWORD, login, text

PAGES = ["/admin/", "/admin/events", "/admin/events/1", "/admin/dead", "/admin/deliveries"]


def _unreachable(db_url: str, tmp_path) -> str:
    if db_url.startswith("sqlite"):
        return f"sqlite:///{tmp_path / 'missing-dir' / 'db.sqlite3'}"
    # Nothing listens on a port that was free a moment ago.
    return f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"


@pytest.fixture
def down(make_app, db_url, tmp_path):
    """A client logged in while the database was up, on an app whose database is away."""
    live = make_app(ADMIN_PASSWORD=PASSWORD).test_client()
    assert login(live).status_code == 302
    # A form's token, taken while the database answered.
    token = re.search(r'name="csrf_token" value="([^"]+)"', text(live.get("/admin/"))).group(1)
    app = make_app(ADMIN_PASSWORD=PASSWORD, SQLALCHEMY_DATABASE_URI=_unreachable(db_url, tmp_path))
    client = app.test_client()
    client.set_cookie("session", live.get_cookie("session", path="/admin").value, path="/admin")
    return client, token


def assert_page_503(response) -> None:
    assert response.status_code == 503, text(response)[:300]
    assert response.mimetype == "text/html"
    assert int(response.headers["Retry-After"]) >= 1
    assert response.headers["Content-Security-Policy"]
    page = text(response)
    assert "<h1>503 Service Unavailable</h1>" in page
    assert "The database cannot be reached" in page


@pytest.mark.parametrize("path", PAGES)
def test_a_page_with_the_database_away_is_an_html_503(down, path):
    client, _ = down
    assert_page_503(client.get(path))


def test_an_action_with_the_database_away_is_an_html_503(down):
    client, token = down
    response = client.post("/admin/deliveries/requeue", data={"ids": "1", "csrf_token": token})
    assert_page_503(response)


def test_a_login_with_the_database_away_is_an_html_503(make_app, db_url, tmp_path):
    app = make_app(ADMIN_PASSWORD=PASSWORD, SQLALCHEMY_DATABASE_URI=_unreachable(db_url, tmp_path))
    client = app.test_client()
    # The form itself needs no database.
    assert client.get("/admin/login").status_code == 200
    assert_page_503(login(client))


def test_a_refused_form_with_the_database_away_is_still_its_400(down):
    # The error page asked the database whether the session was live, to
    # show the menu: the 400 became an exception inside the error handler.
    client, _ = down
    response = client.post("/admin/deliveries/requeue", data={"ids": "1"})
    assert response.status_code == 400
    assert response.mimetype == "text/html"
    assert "The form could not be accepted" in text(response)


def test_the_503_page_tries_the_database_once(down):
    # The page's menu asked the database again whether the session was
    # live: a database that times out its connections made the operator
    # wait out the timeout twice.
    client, _ = down
    app = client.application
    tries = []
    with app.app_context():
        engine = db.engine

    def count(*args):
        tries.append(1)

    sa_event.listen(engine, "do_connect", count)
    assert_page_503(client.get("/admin/events"))
    assert len(tries) == 1
