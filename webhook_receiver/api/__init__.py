"""The client API: events posted with an Idempotency-Key."""

from __future__ import annotations

from flask import Blueprint

bp = Blueprint("api", __name__, url_prefix="/api")

from . import replays, views  # noqa: E402,F401  (registers the routes on bp)
