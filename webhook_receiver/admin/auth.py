"""The admin's password, its session, and the throttle on guessing.

The session cookie holds a keyed digest of the password it was opened with,
so changing ``ADMIN_PASSWORD`` logs every session out, the time it was
opened, so that a session ends after ``ADMIN_SESSION_HOURS`` (12 by default)
whatever the cookie says, and a random session id whose digest is kept in
``admin_sessions``: logging out deletes that row, so a copy of the cookie
(signed, and otherwise valid until it expires) opens nothing afterwards.
Failed logins are recorded in the database, so the throttle holds across
gunicorn workers.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from datetime import datetime, timedelta
from urllib.parse import unquote, urlsplit

from flask import current_app, g, request, session

from ..database import unit_of_work
from ..models import utcnow
from . import logins

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


def _hours() -> float:
    return float(current_app.config.get("ADMIN_SESSION_HOURS", DEFAULT_SESSION_HOURS))


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()


def log_in() -> None:
    """Start a fresh admin session (a new CSRF token too: nothing carries over).

    A session the cookie held (the form posted from a live session) ends on
    the server, as at logout: a copy of its cookie opens nothing after.
    """
    replaced = session.get(SESSION_KEY)
    session.clear()
    session_id = secrets.token_urlsafe(32)
    now = utcnow()
    with unit_of_work():
        if isinstance(replaced, dict) and isinstance(replaced.get("id"), str):
            logins.close_admin_session(_digest(replaced["id"]))
        logins.open_admin_session(_digest(session_id), now, now + timedelta(hours=_hours()))
    session[SESSION_KEY] = {"tag": _session_tag(), "at": int(time.time()), "id": session_id}
    g.admin_logged_in = True


def log_out() -> None:
    """End the admin session, on the server too: a copy of its cookie opens nothing after."""
    data = session.get(SESSION_KEY)
    if isinstance(data, dict) and isinstance(data.get("id"), str):
        with unit_of_work():
            logins.close_admin_session(_digest(data["id"]))
    session.clear()
    g.admin_logged_in = False


def log_out_everywhere() -> None:
    """End every open admin session, this one included: every browser must log in again."""
    with unit_of_work():
        logins.close_every_admin_session()
    session.clear()
    g.admin_logged_in = False


def is_logged_in() -> bool:
    """Tell whether this request's session is a live admin session."""
    # Asked by the guard and by every template: the database is read once.
    if "admin_logged_in" not in g:
        g.admin_logged_in = _session_is_live()
    return bool(g.admin_logged_in)


def _session_is_live() -> bool:
    data = session.get(SESSION_KEY)
    if not isinstance(data, dict) or not _password():
        return False
    tag, opened, session_id = data.get("tag"), data.get("at"), data.get("id")
    if not isinstance(tag, str) or not isinstance(opened, int) or not isinstance(session_id, str):
        return False
    if time.time() - opened > _hours() * 3600:
        return False
    if not hmac.compare_digest(tag, _session_tag()):
        return False
    return logins.admin_session_is_open(_digest(session_id), utcnow())


def remote_addr() -> str:
    """The address the throttle counts against: an IPv4 address, or an IPv6 address's /64.

    One subscriber, one cloud machine, is given a whole IPv6 /64: counted
    address by address, each of its 2**64 addresses had its own tries.
    """
    raw = request.remote_addr or "unknown"
    try:
        address = ipaddress.ip_address(raw)
    except ValueError:
        return raw[:100]  # not an IP address (a Unix socket): counted as it is
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)  # a dual-stack listener's IPv4 client
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


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
        logins.record_login_failure(remote_addr(), now, now - _window())
    return logins.recent_login_failures(remote_addr(), now - _window()) > _max_failures()


def retry_after() -> int:
    """Seconds a throttled address is told to wait."""
    return int(_window().total_seconds())


def forget_failures() -> None:
    """Clear this address's failures after a good login."""
    with unit_of_work():
        logins.clear_login_failures(remote_addr())


def safe_next(target: str | None) -> str | None:
    """Accept a post-login destination only when it is a path inside the admin."""
    if not target or "\\" in target or any(ord(c) < 0x20 for c in target):
        return None
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or target.startswith("//"):
        return None
    if parts.path != "/admin" and not parts.path.startswith("/admin/"):
        return None
    # A browser resolves "." and ".." (%2e%2e too): /admin/../api is /api.
    if any(unquote(segment) in (".", "..") for segment in parts.path.split("/")):
        return None
    return target
