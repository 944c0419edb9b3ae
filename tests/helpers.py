"""What many tests do the same way: count stored rows, post an event to the API, a source."""

from __future__ import annotations

import json
from typing import Any

from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import create_engine, func, select

from webhook_receiver.config import BrokerSourceConfig
from webhook_receiver.extensions import db
from webhook_receiver.models import Event

from .conftest import bearer

ORDER = {"type": "order.created", "data": {"order": 42}}

# A RabbitMQ source as identify sees it (keys from message_id, types from type),
# for tests that identify messages without a broker.
RABBIT_SOURCE = BrokerSourceConfig(
    name="orders",
    provider="rabbitmq",
    url="amqp://guest:guest@127.0.0.1:5672/%2F",
    dedup_key="property:message_id",
    event_type="property:type",
    batch=10,
    queue="orders",
)


def count(app: Flask, model: Any = Event) -> int:
    """The number of rows of ``model``'s table, read in an app context of ``app``."""
    with app.app_context():
        return db.session.scalar(select(func.count()).select_from(model)) or 0


def count_at(db_url: str, model: Any = Event) -> int:
    """The number of rows of ``model``'s table, read on an engine of its own (no app)."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return conn.scalar(select(func.count()).select_from(model.__table__)) or 0
    finally:
        engine.dispose()


def post_event(
    client: FlaskClient,
    key: str = "key-1",
    body: Any = None,
    token: str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "/api/events",
    **kwargs: Any,
) -> Any:
    """POST an event with an Idempotency-Key as a client does; bytes and text are sent as they are.

    ``body`` defaults to an ``order.created`` event, ``token`` to acme's.
    """
    all_headers = {**(bearer(token) if token else bearer()), "Idempotency-Key": key}
    all_headers.update(headers or {})
    if body is None:
        body = ORDER
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return client.post(
        path,
        data=data,
        headers=all_headers,
        content_type=kwargs.pop("content_type", "application/json"),
        **kwargs,
    )
