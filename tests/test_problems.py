"""Errors the app did not expect are answered as problems, with nothing of the error in them."""

from __future__ import annotations


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
