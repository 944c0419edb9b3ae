"""Cookie sessions for the admin pages only.

Machine endpoints (webhooks, the API, probes, metrics) never read or set a
session cookie: they authenticate every request on its own. Skipping the
session there also saves its signing set-up on the hot paths.
"""

from __future__ import annotations

from flask import Flask, Request
from flask.sessions import SecureCookieSession, SecureCookieSessionInterface

ADMIN_PREFIX = "/admin"


class AdminOnlySessionInterface(SecureCookieSessionInterface):
    """Flask's signed-cookie sessions, opened only under /admin."""

    def open_session(self, app: Flask, request: Request) -> SecureCookieSession | None:
        if not request.path.startswith(ADMIN_PREFIX):
            return self.null_session_class()
        return super().open_session(app, request)
