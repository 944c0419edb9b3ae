"""Liveness and readiness probes."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify
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
    """Answer 200 when the database answers, 503 when it does not."""
    try:
        db.session.execute(text("SELECT 1"))
    except Exception as exc:
        db.session.rollback()
        raise Problem("database-unavailable", headers={"Retry-After": "5"}) from exc
    finally:
        db.session.rollback()
    return jsonify(status="ready")
