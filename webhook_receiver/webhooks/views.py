"""The webhook endpoint every provider delivers to."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify, request

from ..config import FileConfig
from ..problems import Problem
from .receipt import receive

bp = Blueprint("webhooks", __name__, url_prefix="/webhooks")


@bp.post("/<source_name>")
def receive_webhook(source_name: str) -> Response:
    """Verify, deduplicate and store one delivery; answer only after the commit."""
    file_config: FileConfig = current_app.config["FILE_CONFIG"]
    source = file_config.sources.get(source_name)
    if source is None:
        raise Problem("unknown-source", f"no source named {source_name!r} is configured")
    receipt = receive(source, request.get_data(cache=False), request.headers, request.remote_addr)
    response = jsonify(receipt.body)
    if receipt.outcome == "duplicate":
        response.headers["Idempotent-Replayed"] = "true"
    return response
