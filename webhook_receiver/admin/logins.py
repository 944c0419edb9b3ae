"""Storage of the admin's logins: failed attempts (for throttling) and open sessions.

Writes start their transaction with the write (see database.py), so SQLite
never has to upgrade a read lock.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, func, insert, select

from ..extensions import db
from ..models import AdminLoginFailure, AdminSession

# -- login throttling --------------------------------------------------------


def recent_login_failures(remote_addr: str, since: datetime) -> int:
    """Count this address's failed logins since ``since``, and end the read."""
    try:
        return int(
            db.session.scalar(
                select(func.count()).where(
                    AdminLoginFailure.remote_addr == remote_addr, AdminLoginFailure.at >= since
                )
            )
            or 0
        )
    finally:
        db.session.rollback()


def record_login_failure(remote_addr: str, now: datetime, keep_since: datetime) -> None:
    """Record a failed login, pruning the ones too old to matter; the caller commits."""
    # The delete comes first so that on SQLite the transaction opens with a write.
    db.session.execute(delete(AdminLoginFailure).where(AdminLoginFailure.at < keep_since))
    db.session.execute(insert(AdminLoginFailure).values(remote_addr=remote_addr, at=now))


def clear_login_failures(remote_addr: str) -> None:
    """Forget an address's failures after it logged in; the caller commits."""
    db.session.execute(
        delete(AdminLoginFailure).where(AdminLoginFailure.remote_addr == remote_addr)
    )


# -- admin sessions ----------------------------------------------------------


def open_admin_session(token_hash: str, now: datetime, expires_at: datetime) -> None:
    """Record an open session, pruning the expired ones; the caller commits."""
    # The delete comes first so that on SQLite the transaction opens with a write.
    db.session.execute(delete(AdminSession).where(AdminSession.expires_at <= now))
    db.session.execute(
        insert(AdminSession).values(token_hash=token_hash, created_at=now, expires_at=expires_at)
    )


def admin_session_is_open(token_hash: str, now: datetime) -> bool:
    """Tell whether the session with this token is open and unexpired, and end the read."""
    try:
        return (
            db.session.scalar(
                select(AdminSession.id).where(
                    AdminSession.token_hash == token_hash, AdminSession.expires_at > now
                )
            )
            is not None
        )
    finally:
        db.session.rollback()


def close_admin_session(token_hash: str) -> None:
    """Forget one session, so that its cookie opens nothing any more; the caller commits."""
    db.session.execute(delete(AdminSession).where(AdminSession.token_hash == token_hash))


def close_every_admin_session() -> int:
    """Forget every open session (log out everywhere); how many. The caller commits."""
    result = db.session.execute(delete(AdminSession))
    return int(getattr(result, "rowcount", 0) or 0)
