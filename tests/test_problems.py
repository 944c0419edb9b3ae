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
