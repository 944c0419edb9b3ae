"""What many tests do the same way: count and write rows, post to the API and the webhooks.

Signing (each provider's secrets and signatures, a signed delivery for each
test source, the provider unit tests' Inbound) is in ``signing.py`` beside
this module. A test imports these rather than keeping a copy of its own.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, NoReturn

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import create_engine, func, select

from webhook_receiver.config import BrokerSourceConfig
from webhook_receiver.extensions import db
from webhook_receiver.models import Event, utcnow

from ..conftest import CI, bearer
from .signing import SOURCES, hmac_hex

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


def unavailable(reason: str) -> NoReturn:
    """Skip the test for want of a tool or a server; in CI, where every test must run, fail it."""
    if CI:
        pytest.fail(f"{reason} (CI: this test must run)")
    pytest.skip(reason)


def unreachable(what: str, exc: BaseException) -> NoReturn:
    """Skip the test (in CI fail it): the server ``what`` did not answer, ``exc`` says how."""
    unavailable(f"{what} is not reachable: {type(exc).__name__}: {exc}")


# -- rows ----------------------------------------------------------------------


def count(app: Flask, model: Any = Event) -> int:
    """The number of rows of ``model``'s table, read in an app context of ``app``."""
    with app.app_context():
        return db.session.scalar(select(func.count()).select_from(model)) or 0


def rows(app: Flask, model: Any = Event) -> list[Any]:
    """Every row of ``model``'s table, by id, read in an app context of ``app``."""
    with app.app_context():
        return list(db.session.scalars(select(model).order_by(model.id)))


def counts(app: Flask, *models: Any) -> dict[str, int]:
    """The number of rows of each model's table, by table name, read in one app context."""
    with app.app_context():
        found = {
            model.__tablename__: db.session.scalar(select(func.count()).select_from(model)) or 0
            for model in models
        }
        db.session.rollback()
        return found


def count_at(db_url: str, model: Any = Event) -> int:
    """The number of rows of ``model``'s table, read on an engine of its own (no app)."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return conn.scalar(select(func.count()).select_from(model.__table__)) or 0
    finally:
        engine.dispose()


def event_row(**columns: Any) -> dict[str, Any]:
    """An ``events`` row's values: a fresh key, an empty JSON body, now; ``columns`` override.

    For tests that need a stored event as a given and write it straight into the table.
    """
    return {
        "source": "test",
        "dedup_key": uuid.uuid4().hex,
        "fingerprint": "0" * 64,
        "body": b"{}",
        "headers": [],
        "meta": {},
        "received_at": utcnow(),
        **columns,
    }


# -- posts ---------------------------------------------------------------------


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


def post_webhook(
    client: FlaskClient, source: str, body: bytes, headers: dict[str, str], **kwargs: Any
) -> Any:
    """POST a delivery, as signed by the caller, to ``/webhooks/<source>``."""
    return client.post(f"/webhooks/{source}", data=body, headers=headers, **kwargs)


def post_hmac(
    client: FlaskClient, source: str, body: bytes, content_type: str = "application/json"
) -> Any:
    """POST ``body`` to a test source of the generic HMAC scheme (``ce``, ``generic-json``).

    The body is signed with the source's secret, ``sha256=<hex>`` in its signature header.
    """
    config = SOURCES[source]
    headers = {
        config["signature_header"]: "sha256=" + hmac_hex(body, config["secrets"][0]),
        "Content-Type": content_type,
    }
    return post_webhook(client, source, body, headers)


def post_binary_cloudevent(
    client: FlaskClient,
    attributes: dict[str, str],
    body: bytes,
    content_type: str | None = "application/json",
    source: str = "ce",
) -> Any:
    """POST a binary-mode CloudEvent to ``source``: its ``attributes`` as ``ce-*`` headers,
    ``body`` its data, signed as post_hmac signs (no Content-Type when ``content_type`` is None).
    """
    config = SOURCES[source]
    headers = {f"ce-{name}": value for name, value in attributes.items()}
    headers[config["signature_header"]] = "sha256=" + hmac_hex(body, config["secrets"][0])
    if content_type is not None:
        headers["Content-Type"] = content_type
    return post_webhook(client, source, body, headers)


def waited_on_a_lock(engine: Any, thread: Any, tries: int = 200) -> bool:
    """Poll until a session of ``engine``'s database waits on a lock (``thread``'s statement
    blocked behind an uncommitted write), ``thread`` waited on between polls; True if one did."""
    from sqlalchemy import text

    query = text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database()"
    )
    with engine.connect() as watcher:
        for _ in range(tries):
            if watcher.execute(query).scalar():
                return True
            watcher.rollback()
            thread.join(0.05)
    return False
