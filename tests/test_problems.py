"""Errors the app did not expect are answered as problems, with nothing of the error in them."""

from __future__ import annotations

import pytest


def test_an_unexpected_error_on_the_api_is_problem_json(make_app) -> None:
    app = make_app(PROPAGATE_EXCEPTIONS=False)

    def boom():
        raise RuntimeError("a bug")

    app.add_url_rule("/api/boom", "boom", boom)
    response = app.test_client().get("/api/boom")
    assert response.status_code == 500
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == "/problems/internal-error"
    assert "a bug" not in response.get_data(as_text=True)


@pytest.mark.parametrize(
    "path", ["/openapi.json", "/problems", "/problems/", "/problems/bad-request"]
)
def test_a_wrong_method_on_the_document_or_the_problem_types_is_405_problem_json(client, path):
    # /openapi.json and /problems (no trailing slash) answered Werkzeug's HTML
    # page: only paths under a listed prefix got problem+json.
    response = client.post(path)
    assert response.status_code == 405
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["type"] == "/problems/method-not-allowed"
    assert {m.strip() for m in response.headers["Allow"].split(",")} == {"GET", "HEAD", "OPTIONS"}


def test_the_api_on_a_database_without_its_schema_is_503_not_500(tmp_path) -> None:
    # Code ahead of its migrations (an empty SQLite file here) answered 500
    # internal-error; /readyz says 503, and nothing was committed.
    from webhook_receiver import create_app

    from .conftest import ACME_TOKEN, CLIENTS

    app = create_app(
        {
            "TESTING": True,
            "PROPAGATE_EXCEPTIONS": False,
            "SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 'empty.sqlite3'}",
            "RECEIVER_CONFIG": {"clients": CLIENTS},
        }
    )
    client = app.test_client()
    auth = {"Authorization": f"Bearer {ACME_TOKEN}"}
    for response in (
        client.post(
            "/api/events",
            json={"type": "t", "data": 1},
            headers={**auth, "Idempotency-Key": "k-1"},
        ),
        client.get("/api/events/1", headers=auth),
    ):
        assert response.status_code == 503, response.get_data(as_text=True)
        assert response.mimetype == "application/problem+json"
        assert response.get_json()["type"] == "/problems/database-unavailable"
        assert response.headers["Retry-After"] == "30"
