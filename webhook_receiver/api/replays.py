"""Replays of an API event's Idempotency-Key, recorded as the event's duplicates.

A client's retry is answered from the saved response (the ``@idempotent``
engine) and never reaches the view; like a provider's redelivery, it is
then noted as an ``event_duplicates`` row (its ``duplicate_count``), in
the batches of duplicates.py, so the admin shows every copy that came.
"""

from __future__ import annotations

import json
import logging

from flask import Response, request

from ..inbox import duplicates
from ..models import utcnow
from .views import bp

log = logging.getLogger(__name__)


@bp.after_request
def record_replay(response: Response) -> Response:
    """Note a replayed creation as a duplicate of the event it created."""
    if (
        request.endpoint != "api.create_event"
        or response.headers.get("Idempotent-Replayed") != "true"
        or response.status_code != 201
    ):
        return response
    try:
        event_id = int(json.loads(response.get_data())["id"])
    except (ValueError, KeyError, TypeError):
        return response  # not an event's answer: nothing to count
    try:
        duplicates.record(event_id, utcnow())
    except Exception:
        # Bookkeeping only: the saved answer goes out whatever happens here.
        log.warning("could not record the replay of event %s", event_id, exc_info=True)
    return response
