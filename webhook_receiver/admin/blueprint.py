"""The admin blueprint and the checks every admin request passes.

In order: no password configured means no admin at all (404); a
state-changing request must carry a valid CSRF token (400 otherwise, before
any view runs); every page but the login form needs a logged-in session;
no query or form field may hold a NUL (400).
Every response carries a strict Content-Security-Policy and is not cached.
A database that is away is an HTML page too (503), not the machine
surfaces' problem+json.
"""

from __future__ import annotations

import os
from typing import Any

from flask import (
    Blueprint,
    Response,
    abort,
    current_app,
    g,
    redirect,
    render_template,
    request,
    url_for,
)
from flask.typing import ResponseReturnValue
from flask_wtf.csrf import CSRFError
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from werkzeug.datastructures import MultiDict
from werkzeug.exceptions import HTTPException
from werkzeug.http import HTTP_STATUS_CODES

from ..extensions import csrf, db
from . import auth, paging, presenters

PREFIX = "/admin"
_STATIC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "static")

bp = Blueprint(
    "admin",
    __name__,
    url_prefix=PREFIX,
    static_folder=os.path.join(_STATIC, "admin"),
    static_url_path="/static",
)

# Scripts are not needed at all: the chart is SVG drawn on the server.
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'none'",
        "object-src 'none'",
        "style-src 'self'",
        "img-src 'self'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
_OPEN_ENDPOINTS = frozenset({"admin.login", "admin.static"})
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# An admin form is a password, a filter or a review's note, far below this.
# The app's own limit (MAX_BODY_BYTES, 1 MiB, for webhooks) let anyone make
# the login form's parse, before any check, take half a second of CPU.
ADMIN_MAX_BODY_BYTES = 64 * 1024


def _is_admin_path() -> bool:
    return request.path == PREFIX or request.path.startswith(PREFIX + "/")


def _bound_admin_body() -> None:
    # Werkzeug refuses a longer body (413) when the form is first read;
    # problems.py's read of a chunked body up front stops at it too.
    if _is_admin_path():
        request.max_content_length = ADMIN_MAX_BODY_BYTES


@bp.record_once
def _bound_before_any_read(state: Any) -> None:
    # First of the app's hooks: problems.py's (registered before the
    # blueprint) reads a chunked body, up to the limit it finds then.
    state.app.before_request_funcs.setdefault(None, []).insert(0, _bound_admin_body)


@bp.before_app_request
def hide_when_off() -> None:
    """Answer 404 for every /admin URL when no password is configured.

    App-wide, so that it runs before routing answers a redirect or a 405,
    which would tell that the admin exists.
    """
    if _is_admin_path() and not current_app.config.get("ADMIN_PASSWORD"):
        abort(404)


@bp.before_request
def guard() -> ResponseReturnValue | None:
    """Check CSRF on state-changing requests, and require a login."""
    if request.method not in _SAFE_METHODS:
        # Checked whatever WTF_CSRF_ENABLED says: the admin never runs unprotected.
        csrf.protect()
    if request.endpoint in _OPEN_ENDPOINTS or auth.is_logged_in():
        return None
    if request.method in _SAFE_METHODS:
        return redirect(url_for("admin.login", next=request.full_path.rstrip("?")))
    abort(403)


@bp.before_request
def refuse_ids_out_of_range() -> None:
    """Answer 404 for an id in the URL beyond 64 bits: no row has one, and no driver binds it."""
    # Registered after guard, so the CSRF and login checks come first.
    if any(isinstance(v, int) and v > paging.MAX_ID for v in (request.view_args or {}).values()):
        abort(404)


def _holds_nul(fields: MultiDict[str, str]) -> bool:
    return any(
        "\x00" in name or any("\x00" in v for v in values) for name, values in fields.lists()
    )


@bp.before_request
def refuse_nul() -> None:
    """Answer 400 for a NUL in any query or form field, before a view reads it.

    No stored text holds one (PostgreSQL's text cannot, and the intakes
    keep none), and PostgreSQL's driver refuses to send one: a filter or a
    review note with a NUL was a 500 there, and found nothing on SQLite.
    Checked here, once, for every filter and form of the admin.
    """
    # Registered after guard, so the CSRF and login checks come first.
    if _holds_nul(request.args) or (
        request.method not in _SAFE_METHODS and _holds_nul(request.form)
    ):
        abort(
            400,
            "A filter or form field holds a NUL character (%00), which no stored value "
            "contains. Nothing was changed; remove it and try again.",
        )


@bp.after_app_request
def security_headers(response: Response) -> Response:
    """Add the CSP and its companions to every /admin response, and keep pages out of caches."""
    # App-wide, so that a 404 for an /admin URL no route matches gets them too.
    if not _is_admin_path():
        return response
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    if request.endpoint != "admin.static":
        response.headers["Cache-Control"] = "no-store"
    return response


def _error_page(exc: HTTPException) -> tuple[str, int] | HTTPException:
    if not current_app.config.get("ADMIN_PASSWORD"):
        return exc  # the plain 404 of any unknown URL: nothing says there is an admin
    message = exc.description
    if isinstance(exc, CSRFError):
        message = (
            f"The form could not be accepted: {exc.description} "
            "Reload the page and try again; nothing was changed."
        )
    return render_template("admin/error.html", code=exc.code, name=exc.name, message=message), (
        exc.code or 500
    )


for _code in (400, 403, 404, 405, 413, 429):
    bp.register_error_handler(_code, _error_page)


PROBLEM_JSON = "application/problem+json"


@bp.after_request
def problems_as_pages(response: Response) -> Response:
    """Show a problem the app's handlers answered (the database away: 503) as an admin page.

    problems.py tells an outage (503, Retry-After) from a bug (500) and logs
    it; an operator's browser gets that verdict as a page, not as JSON.
    """
    if response.mimetype != PROBLEM_JSON:
        return response
    problem = response.get_json(silent=True) or {}
    message = str(problem.get("title") or "The request failed")
    if problem.get("detail"):
        message += f": {problem['detail']}"
    message += "."
    if response.status_code == 503:
        message += " Try again in a moment."
    # Unknown if the session check itself failed: asking the database again
    # would wait out a second connection timeout for the menu alone.
    g.setdefault("admin_logged_in", False)
    page = render_template(
        "admin/error.html",
        code=response.status_code,
        name=HTTP_STATUS_CODES.get(response.status_code, "Error"),
        message=message,
    )
    html = Response(page, status=response.status_code, mimetype="text/html")
    if "Retry-After" in response.headers:
        html.headers["Retry-After"] = response.headers["Retry-After"]
    return html


@bp.context_processor
def helpers() -> dict[str, object]:
    """Formatting helpers and the login state for every admin template."""
    return {
        "utc": presenters.utc,
        "local_input": presenters.local_input,
        "logged_in": _logged_in_if_known(),
    }


def _logged_in_if_known() -> bool:
    """Whether to show the menu; False when the database cannot say.

    Every page but an error page has asked already (the guard). An error
    page, such as a refused CSRF token or the database away, must render
    without the database: asking it again there failed the error page itself.
    """
    if "admin_logged_in" in g:
        return bool(g.admin_logged_in)
    try:
        return auth.is_logged_in()
    except (DBAPIError, PoolTimeout):
        db.session.rollback()
        g.admin_logged_in = False
        return False
