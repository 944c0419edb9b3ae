"""The webhook endpoint every provider delivers to."""

from __future__ import annotations

import logging

from flask import Blueprint, Response, current_app, jsonify, request

from ..config import FileConfig, SourceConfig
from ..problems import Problem
from .providers import PayloadError, handshake
from .receipt import receive

bp = Blueprint("webhooks", __name__, url_prefix="/webhooks")
log = logging.getLogger(__name__)


def _source(source_name: str) -> SourceConfig | None:
    file_config: FileConfig = current_app.config["FILE_CONFIG"]
    return file_config.sources.get(source_name)


def _not_a_webhook_source(source_name: str) -> str:
    file_config: FileConfig = current_app.config["FILE_CONFIG"]
    broker = file_config.brokers.get(source_name)
    if broker is not None:
        # Configured, but fed by its broker: saying "not configured" would send
        # an operator looking for a typo in the config.
        return (
            f"{source_name!r} is a broker source ({broker.provider}): "
            "it is consumed from its broker, not posted to"
        )
    return f"no source named {source_name!r} is configured"


# OPTIONS has a view of its own (validate_webhook), so Flask's is turned off here.
@bp.post("/<source_name>", provide_automatic_options=False)
def receive_webhook(source_name: str) -> Response:
    """Verify, deduplicate and store one delivery; answer only after the commit."""
    source = _source(source_name)
    if source is None:
        raise Problem("unknown-source", _not_a_webhook_source(source_name))
    receipt = receive(source, request.get_data(cache=False), request.headers, request.remote_addr)
    response = jsonify(receipt.body)
    if receipt.outcome == "duplicate":
        response.headers["Idempotent-Replayed"] = "true"
    return response


@bp.route("/<source_name>", methods=["OPTIONS"])
def validate_webhook(source_name: str) -> Response:
    """Answer a CloudEvents webhook validation request; any other OPTIONS as Flask would."""
    source = _source(source_name)
    try:
        answer = handshake(source, request.headers) if source is not None else None
    except PayloadError as exc:
        raise Problem("bad-request", str(exc)) from exc
    if answer is None:
        return current_app.make_default_options_response()
    log.info(
        "webhook validation answered",
        extra={
            "outcome": "handshake",
            "source": source_name,
            "origin": answer["WebHook-Allowed-Origin"],
        },
    )
    response = current_app.response_class(status=200)
    response.headers.update(answer)
    return response
