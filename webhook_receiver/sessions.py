"""Cookie sessions for the admin pages only.

Machine endpoints (webhooks, the API, probes, metrics) never read or set a
session cookie: they authenticate every request on its own. Skipping the
session there also saves its signing set-up on the hot paths.

The cookie is scoped to the admin's path (``Path=/admin``, under the app's
script root when mounted below one): with ``Path=/`` a browser sent it with
every webhook and API request to the host, and to any other app served
there under another path. It is ``Secure`` whenever the request came over
HTTPS, whatever ``SESSION_COOKIE_SECURE`` says.
"""

from __future__ import annotations

from flask import Flask, Request, Response, has_request_context, request
from flask.sessions import SecureCookieSession, SecureCookieSessionInterface, SessionMixin

ADMIN_PREFIX = "/admin"
# Where the cookie lived before it was scoped to the admin.
_UNSCOPED_PATH = "/"


class AdminOnlySessionInterface(SecureCookieSessionInterface):
    """Flask's signed-cookie sessions, opened only under /admin, their cookie scoped to it."""

    def open_session(self, app: Flask, request: Request) -> SecureCookieSession | None:
        if not request.path.startswith(ADMIN_PREFIX):
            return self.null_session_class()
        return super().open_session(app, request)

    def get_cookie_path(self, app: Flask) -> str:
        """The admin's path: setting and clearing the cookie both use it, or a clear misses."""
        root = request.script_root if has_request_context() else ""
        return (root or "") + ADMIN_PREFIX

    def get_cookie_secure(self, app: Flask) -> bool:
        """Secure when configured, and always when this request came over HTTPS.

        The setting defaults to off (plain-HTTP development): an admin served
        over TLS without it handed out a cookie the browser also sends over
        plain HTTP, to anyone on the path who makes it ask http://<host>/admin/.
        """
        secure = super().get_cookie_secure(app)
        return secure or (has_request_context() and request.is_secure)

    def save_session(self, app: Flask, session: SessionMixin, response: Response) -> None:
        """Save as Flask does; whenever that writes the cookie, expire an unscoped one too.

        A browser logged in before the cookie was scoped keeps its
        ``Path=/`` cookie beside the new one (another path is another
        cookie), sent to every URL of the host until it is expired.
        """
        super().save_session(app, session, response)
        name = self.get_cookie_name(app)
        written = any(
            header.startswith(f"{name}=") for header in response.headers.getlist("Set-Cookie")
        )
        if written and self.get_cookie_path(app) != _UNSCOPED_PATH:
            response.delete_cookie(
                name,
                domain=self.get_cookie_domain(app),
                path=_UNSCOPED_PATH,
                secure=self.get_cookie_secure(app),
                samesite=self.get_cookie_samesite(app),
                httponly=self.get_cookie_httponly(app),
            )
