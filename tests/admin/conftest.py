"""Admin fixtures: an app with a password, a logged-in client, and rows written by hand."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from webhook_receiver.extensions import db
from webhook_receiver.models import (
    Delivery,
    Event,
    EventConflict,
    EventDuplicate,
    IdempotencyRecord,
    Rejection,
)

PASSWORD = "correct horse battery staple"
NOW = datetime.now(UTC).replace(microsecond=0)
_TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')


@pytest.fixture
def admin_app(make_app: Callable[..., Flask]) -> Flask:
    """The app with the admin switched on."""
    return make_app(ADMIN_PASSWORD=PASSWORD)


@pytest.fixture
def anon(admin_app: Flask) -> FlaskClient:
    """A client that has not logged in."""
    return admin_app.test_client()


@pytest.fixture
def admin(admin_app: Flask) -> FlaskClient:
    """A logged-in client."""
    client = admin_app.test_client()
    response = login(client)
    assert response.status_code == 302, response.get_data(as_text=True)
    return client


def csrf_token(client: FlaskClient, path: str = "/admin/login") -> str:
    """Read the CSRF token from a page, as a browser's form would carry it."""
    page = client.get(path)
    match = _TOKEN.search(page.get_data(as_text=True))
    assert match, f"no CSRF token on {path}"
    return match.group(1)


def login(client: FlaskClient, password: str = PASSWORD, **extra: Any) -> Any:
    """Post the login form with a valid CSRF token."""
    token = csrf_token(client, "/admin/login")
    return client.post("/admin/login", data={"password": password, "csrf_token": token, **extra})


def post(client: FlaskClient, url: str, data: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """Post an admin form with a valid CSRF token."""
    token = csrf_token(client, "/admin/")
    return client.post(url, data={**(data or {}), "csrf_token": token}, **kwargs)


def text(response: Any) -> str:
    return response.get_data(as_text=True)


# -- rows --------------------------------------------------------------------

_serial = iter(range(1, 10**9))


def add(app: Flask, row: Any) -> int:
    """Insert one model row and return its id."""
    with app.app_context():
        db.session.add(row)
        db.session.commit()
        return row.id


def event(
    app: Flask,
    *,
    source: str = "stripe",
    dedup_key: str | None = None,
    event_type: str | None = "invoice.paid",
    body: bytes = b'{"id": "evt_1", "amount": 100}',
    content_type: str | None = "application/json",
    headers: list[list[str]] | None = None,
    received_at: datetime | None = None,
    **kwargs: Any,
) -> int:
    """Store an event as the receipt code would (its duplicates: see duplicate())."""
    n = next(_serial)
    return add(
        app,
        Event(
            source=source,
            dedup_key=dedup_key or f"key-{n}",
            event_type=event_type,
            fingerprint=f"{n:064x}",
            content_type=content_type,
            body=body,
            headers=headers if headers is not None else [["Content-Type", "application/json"]],
            meta=kwargs.pop("meta", {}),
            received_at=received_at or NOW,
            **kwargs,
        ),
    )


def delivery(
    app: Flask,
    event_id: int,
    *,
    consumer: str = "billing",
    state: str = "pending",
    attempts: int = 0,
    last_error: str | None = None,
    response_status: int | None = None,
    updated_at: datetime | None = None,
    **kwargs: Any,
) -> int:
    """Store one consumer's delivery of an event."""
    return add(
        app,
        Delivery(
            event_id=event_id,
            consumer=consumer,
            kind=kwargs.pop("kind", "forward"),
            state=state,
            attempts=attempts,
            next_attempt_at=kwargs.pop("next_attempt_at", NOW),
            last_error=last_error,
            response_status=response_status,
            created_at=kwargs.pop("created_at", NOW),
            updated_at=updated_at or NOW,
            **kwargs,
        ),
    )


def duplicate(app: Flask, event_id: int, received_at: datetime | None = None) -> int:
    return add(app, EventDuplicate(event_id=event_id, received_at=received_at or NOW))


def conflict(
    app: Flask,
    event_id: int,
    *,
    body: bytes = b'{"id": "evt_1", "amount": 250}',
    received_at: datetime | None = None,
    **kwargs: Any,
) -> int:
    with app.app_context():
        original = db.session.get(Event, event_id)
        source, key = original.source, original.dedup_key
    return add(
        app,
        EventConflict(
            event_id=event_id,
            source=source,
            dedup_key=key,
            fingerprint=kwargs.pop("fingerprint", f"{next(_serial):064x}"),
            content_type=kwargs.pop("content_type", "application/json"),
            body=body,
            headers=kwargs.pop("headers", [["Content-Type", "application/json"]]),
            received_at=received_at or NOW,
            last_seen_at=received_at or NOW,
            seen_count=kwargs.pop("seen_count", 1),
            **kwargs,
        ),
    )


def rejection(app: Flask, *, received_at: datetime | None = None, **kwargs: Any) -> int:
    return add(
        app,
        Rejection(
            source=kwargs.pop("source", "stripe"),
            reason=kwargs.pop("reason", "signature"),
            detail=kwargs.pop("detail", "no signature matched"),
            remote_addr=kwargs.pop("remote_addr", "203.0.113.9"),
            received_at=received_at or NOW,
        ),
    )


def idempotency_record(
    app: Flask,
    *,
    client: str = "acme",
    key: str = "k-1",
    state: str = "completed",
    created_at: datetime | None = None,
    ttl: timedelta = timedelta(hours=24),
    **kwargs: Any,
) -> int:
    created = created_at or NOW
    return add(
        app,
        IdempotencyRecord(
            client=client,
            key=key,
            fingerprint="f" * 64,
            method="POST",
            path="/api/events",
            state=state,
            created_at=created,
            expires_at=created + ttl,
            response_status=201 if state == "completed" else None,
            **kwargs,
        ),
    )
