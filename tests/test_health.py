"""Probes, and the problem+json answers for routes and methods that do not exist."""

from __future__ import annotations

import pytest

from .conftest import bearer
from .databases import read_only


def test_healthz_answers_while_the_process_runs(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.get_json() == {"status": "ok"}


def test_readyz_answers_200_when_the_database_answers(client):
    response = client.get("/readyz")
    assert response.status_code == 200
    from webhook_receiver.health import _migration_head

    head = _migration_head(client.application.extensions["migrate"].directory)
    assert response.get_json() == {"status": "ready", "schema": head}
    assert head is not None


def test_probes_need_no_credentials_and_take_no_writes(client):
    assert client.get("/healthz", headers=bearer("wrong-token-0123456789")).status_code == 200
    for path in ("/healthz", "/readyz"):
        response = client.post(path)
        assert response.status_code == 405
        assert response.mimetype == "application/problem+json"


@pytest.mark.parametrize(
    "path",
    ["/api", "/api/", "/api/nope", "/api/events/not-a-number", "/api/events/1/extra", "/webhooks"],
)
def test_unknown_api_route_is_404_problem_json(client, path):
    response = client.get(path, headers=bearer())
    assert response.status_code == 404
    assert response.mimetype == "application/problem+json"
    doc = response.get_json()
    assert doc["type"] == "/problems/not-found"
    assert doc["status"] == 404
    assert doc["title"]


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/api/events", {"POST", "OPTIONS"}),
        ("PUT", "/api/events", {"POST", "OPTIONS"}),
        ("DELETE", "/api/events/1", {"GET", "HEAD", "OPTIONS"}),
        ("PATCH", "/api/events/1", {"GET", "HEAD", "OPTIONS"}),
    ],
)
def test_wrong_method_is_405_problem_json_with_allow(client, method, path, allowed):
    response = client.open(path, method=method, headers=bearer())
    assert response.status_code == 405
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == "/problems/method-not-allowed"
    assert {m.strip() for m in response.headers["Allow"].split(",")} == allowed


def test_unknown_route_outside_the_api_is_not_problem_json(client):
    # The admin pages and the rest speak HTML; only machine surfaces get problem+json.
    response = client.get("/no-such-page")
    assert response.status_code == 404
    assert response.mimetype == "text/html"


def test_problem_types_are_described(client):
    response = client.get("/problems/database-unavailable")
    assert response.status_code == 200
    assert response.get_json()["status"] == 503
    assert client.get("/problems/no-such-problem").status_code == 404


def test_readyz_refuses_a_database_without_the_current_schema(make_app, db_url):
    """A reachable database at an older (or no) revision is not ready."""
    from sqlalchemy import text

    from webhook_receiver.extensions import db

    app = make_app()
    client = app.test_client()
    ready = client.get("/readyz")
    assert ready.status_code == 200
    head = ready.get_json()["schema"]
    with app.app_context():
        db.session.execute(text("UPDATE alembic_version SET version_num = '0001'"))
        db.session.commit()
    stale = client.get("/readyz")
    assert stale.status_code == 503
    assert stale.mimetype == "application/problem+json"
    assert "run the migrations" in stale.get_json()["detail"]
    with app.app_context():
        db.session.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": head})
        db.session.commit()
    assert client.get("/readyz").status_code == 200


def test_readyz_refuses_an_empty_sqlite_file(make_app, tmp_path):
    app = make_app(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'empty.sqlite3'}")
    response = app.test_client().get("/readyz")
    assert response.status_code == 503
    assert response.get_json()["type"] == "/problems/database-unavailable"
    # Reachable, with no schema: the answer said it could not be reached.
    assert "run the migrations" in response.get_json()["detail"]


def test_readyz_on_a_database_without_any_table_says_to_run_the_migrations(make_app, db_url):
    from sqlalchemy import text

    from webhook_receiver.extensions import db

    app = make_app()
    with app.app_context():
        db.session.execute(text("DROP TABLE alembic_version"))
        db.session.commit()
    try:
        response = app.test_client().get("/readyz")
        assert response.status_code == 503
        assert response.mimetype == "application/problem+json"
        assert "run the migrations" in response.get_json()["detail"]
    finally:
        with app.app_context():
            db.session.execute(
                text("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
            )
            db.session.execute(text("INSERT INTO alembic_version VALUES (:v)"), {"v": _head(app)})
            db.session.commit()


def _head(app):
    from webhook_receiver.health import _migration_head

    return _migration_head(app.extensions["migrate"].directory)


def test_readyz_is_503_while_the_database_refuses_writes(make_app, db_url) -> None:
    writable = make_app().test_client()
    assert writable.get("/readyz").status_code == 200
    client = make_app(**read_only(db_url)).test_client()
    # Reads still work (the probe used to stop there) ...
    assert client.get("/api/events/1", headers=bearer()).status_code == 404
    # ... but a delivery could not be stored.
    response = client.get("/readyz")
    assert response.status_code == 503, response.get_data(as_text=True)
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == "/problems/database-unavailable"
    assert client.get("/healthz").status_code == 200


def test_readyz_on_a_schema_newer_than_the_code_does_not_say_to_run_the_migrations(
    make_app, db_url
):
    """A revision the code does not know (newer code migrated it): 503, and the true fix."""
    from sqlalchemy import text

    from webhook_receiver.extensions import db

    app = make_app()
    head = _head(app)
    with app.app_context():
        db.session.execute(text("UPDATE alembic_version SET version_num = 'f00dfeed0099'"))
        db.session.commit()
    try:
        response = app.test_client().get("/readyz")
        assert response.status_code == 503
        assert response.mimetype == "application/problem+json"
        assert response.headers["Retry-After"] == "30"
        detail = response.get_json()["detail"]
        # 'flask db upgrade' cannot help: it fails on a revision it cannot locate.
        assert "run the migrations" not in detail
        assert "f00dfeed0099" in detail and head in detail
        assert "does not know" in detail
    finally:
        with app.app_context():
            db.session.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": head})
            db.session.commit()
