"""Liveness and readiness probes."""

from __future__ import annotations

import functools
import os
from typing import Any

from flask import Blueprint, Response, current_app, jsonify
from sqlalchemy import text

from .database import damage_message, is_damaged, is_missing_schema
from .extensions import db
from .problems import Problem

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    """Answer while the process runs."""
    return jsonify(status="ok")


# A write that changes nothing, rolled back: ready means able to store a
# delivery, and a database that answers reads may still refuse every write
# (a read-only file or mount, a standby, default_transaction_read_only).
# It comes first: on SQLite a transaction must open with its write.
_WRITE_PROBE = text("UPDATE alembic_version SET version_num = version_num")


@bp.get("/readyz")
def readyz() -> Response:
    """Answer 200 when the database takes writes and has the current schema, else 503."""
    try:
        db.session.execute(_WRITE_PROBE)
        version = db.session.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except Exception as exc:
        db.session.rollback()
        # Unreachable, read-only, or reachable with no schema yet (an SQLite
        # file is created on first connect): not ready to take traffic.
        if is_damaged(exc):
            # No wait ends it: an operator must restore the database.
            current_app.logger.error("not ready: %s", damage_message(exc))
            raise Problem(
                "database-unavailable",
                "the database is damaged: restore it from a backup",
                headers={"Retry-After": "30"},
            ) from exc
        current_app.logger.warning("not ready: %s", exc)
        if is_missing_schema(exc):
            # Reachable, and writable for all we know: say what to do.
            raise Problem(
                "database-unavailable",
                "the database has no schema yet: run the migrations",
                headers={"Retry-After": "30"},
            ) from exc
        raise Problem(
            "database-unavailable",
            "the database cannot be reached or does not take writes",
            headers={"Retry-After": "5"},
        ) from exc
    finally:
        db.session.rollback()
    directory = current_app.extensions["migrate"].directory
    head = _migration_head(directory)
    if version != head:
        if version is not None and version not in _revisions(directory):
            # Newer code migrated it (a rolling deploy): the migrations this
            # code has cannot help, 'flask db upgrade' fails on the revision.
            detail = (
                f"the schema is at revision {version}, which this code does not know (its "
                f"head is {head}): run the code that migrated it"
            )
        else:
            detail = (
                f"the schema is at revision {version}, the code needs {head}: run the migrations"
            )
        raise Problem("database-unavailable", detail, headers={"Retry-After": "30"})
    return jsonify(status="ready", schema=version)


@functools.cache
def _migration_head(directory: str) -> str | None:
    return _scripts(directory).get_current_head()


@functools.cache
def _revisions(directory: str) -> frozenset[str]:
    return frozenset(script.revision for script in _scripts(directory).walk_revisions())


def _scripts(directory: str) -> Any:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", os.path.abspath(directory))
    return ScriptDirectory.from_config(config)
