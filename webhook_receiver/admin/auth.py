"""The admin's password, its session, and the throttle on guessing.

The session holds a keyed digest of the password it was opened with, so
changing ``ADMIN_PASSWORD`` logs every session out, and the time it was
opened, so that a session ends after ``ADMIN_SESSION_HOURS`` (12 by default)
whatever the cookie says. Failed logins are recorded in the database, so
the throttle holds across gunicorn workers.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from flask import current_app, request, session

from ..database import unit_of_work
from . import queries

SESSION_KEY = "admin"
DEFAULT_SESSION_HOURS = 12
DEFAULT_MAX_FAILURES = 5
DEFAULT_FAILURE_WINDOW = timedelta(minutes=15)


def _password() -> str:
    return str(current_app.config.get("ADMIN_PASSWORD") or "")


def password_matches(candidate: str) -> bool:
    """Compare a candidate with the configured password in constant time."""
    expected = _password()
    if not expected:
        return False
    # Comparing digests keeps even the password's length out of the timing.
    return hmac.compare_digest(
        hashlib.sha256(candidate.encode("utf-8", "surrogatepass")).digest(),
        hashlib.sha256(expected.encode("utf-8", "surrogatepass")).digest(),
    )


def _session_tag() -> str:
    key = str(current_app.config["SECRET_KEY"]).encode()
    return hmac.new(key, b"admin-session:" + _password().encode(), hashlib.sha256).hexdigest()


def log_in() -> None:
    """Start a fresh admin session (a new CSRF token too: nothing carries over)."""
    session.clear()
    session[SESSION_KEY] = {"tag": _session_tag(), "at": int(time.time())}


def log_out() -> None:
    """End the admin session."""
    session.clear()


def is_logged_in() -> bool:
    """Tell whether this request's session is a live admin session."""
    data = session.get(SESSION_KEY)
    if not isinstance(data, dict) or not _password():
        return False
    tag, opened = data.get("tag"), data.get("at")
    if not isinstance(tag, str) or not isinstance(opened, int):
        return False
    hours = float(current_app.config.get("ADMIN_SESSION_HOURS", DEFAULT_SESSION_HOURS))
    if time.time() - opened > hours * 3600:
        return False
    return hmac.compare_digest(tag, _session_tag())


def remote_addr() -> str:
    """The address the throttle counts against."""
    return (request.remote_addr or "unknown")[:100]


def _window() -> timedelta:
    seconds = current_app.config.get("ADMIN_LOGIN_WINDOW_SECONDS")
    return DEFAULT_FAILURE_WINDOW if seconds is None else timedelta(seconds=int(seconds))


def _max_failures() -> int:
    return int(current_app.config.get("ADMIN_LOGIN_MAX_FAILURES", DEFAULT_MAX_FAILURES))


def attempt_is_throttled(now: datetime) -> bool:
    """Record this login attempt as a failure, then tell whether it is one too many.

    Counting first and recording after (check, then insert) let concurrent
    guesses all pass the check before any was recorded: 40 at once got 6
    tries against a limit of 5. Recorded first and committed, each attempt
    is in every count that starts after it, so the last of N concurrent
    attempts counts all N, and at most the limit ever reach the password.
    A good password clears the address's failures, its own included.
    """
    with unit_of_work():
        queries.record_login_failure(remote_addr(), now, now - _window())
    return queries.recent_login_failures(remote_addr(), now - _window()) > _max_failures()


def retry_after() -> int:
    """Seconds a throttled address is told to wait."""
    return int(_window().total_seconds())


def forget_failures() -> None:
    """Clear this address's failures after a good login."""
    with unit_of_work():
        queries.clear_login_failures(remote_addr())


def safe_next(target: str | None) -> str | None:
    """Accept a post-login destination only when it is a path inside the admin."""
    if not target or "\\" in target or any(ord(c) < 0x20 for c in target):
        return None
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or target.startswith("//"):
        return None
    if parts.path != "/admin" and not parts.path.startswith("/admin/"):
        return None
    return target
