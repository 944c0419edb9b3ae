"""An admin form's body is bounded far below the webhooks' limit, before anything reads it.

The login form was parsed (for its CSRF token) before any check, under the
app's 1 MiB limit: anyone could post 500,000 fields and cost a worker half
a second of CPU a request.
"""

from __future__ import annotations

import io

from flask.testing import FlaskClient

from webhook_receiver.admin.blueprint import ADMIN_MAX_BODY_BYTES

from .conftest import csrf_token, login, text

_MANY_FIELDS = b"&".join(b"f%d=1" % i for i in range(ADMIN_MAX_BODY_BYTES // 4))
FORM = "application/x-www-form-urlencoded"


def test_a_login_post_past_the_admin_limit_is_413_and_logs_nobody_in(anon: FlaskClient):
    assert ADMIN_MAX_BODY_BYTES < len(_MANY_FIELDS) < 1024 * 1024
    token = csrf_token(anon, "/admin/login")
    body = b"csrf_token=" + token.encode() + b"&password=x&" + _MANY_FIELDS
    response = anon.post("/admin/login", data=body, content_type=FORM)
    assert response.status_code == 413, response.status_code
    assert response.mimetype == "text/html"
    assert "Request Entity Too Large" in text(response)
    assert anon.get("/admin/").status_code == 302  # still logged out


def test_a_chunked_form_past_the_limit_is_413_too(anon: FlaskClient):
    # No Content-Length to refuse up front: the limit ends the read.
    response = anon.post(
        "/admin/login",
        input_stream=io.BytesIO(b"password=x&" + _MANY_FIELDS),
        content_type=FORM,
        headers={"Transfer-Encoding": "chunked"},
        # As gunicorn says of a chunked body: read it to its end.
        environ_overrides={"wsgi.input_terminated": True},
    )
    assert response.status_code == 413


def test_forms_within_the_limit_still_work(anon: FlaskClient):
    assert login(anon, padding="p" * (ADMIN_MAX_BODY_BYTES // 2)).status_code == 302
    assert anon.get("/admin/").status_code == 200
