"""Liveness and readiness probes."""

from __future__ import annotations

import functools
import os

from flask import Blueprint, Response, current_app, jsonify
from sqlalchemy import text

from .extensions import db
from .problems import Problem

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    """Answer while the process runs."""
    return jsonify(status="ok")


@bp.get("/readyz")
def readyz() -> Response:
    """Answer 200 when the database answers with the current schema, else 503."""
    try:
        version = db.session.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except Exception as exc:
        db.session.rollback()
        # Unreachable, or reachable with no schema yet (an SQLite file is
        # created on first connect): either way not ready to take traffic.
        raise Problem("database-unavailable", headers={"Retry-After": "5"}) from exc
    finally:
        db.session.rollback()
    head = _migration_head(current_app.extensions["migrate"].directory)
    if version != head:
        raise Problem(
            "database-unavailable",
            f"the schema is at revision {version}, the code needs {head}: run the migrations",
            headers={"Retry-After": "30"},
        )
    return jsonify(status="ready", schema=version)


@functools.cache
def _migration_head(directory: str) -> str | None:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", os.path.abspath(directory))
    return ScriptDirectory.from_config(config).get_current_head()
