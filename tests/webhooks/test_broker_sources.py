"""A broker source's name under /webhooks/: a 404 that says it is a broker source."""

from __future__ import annotations

import pytest

from ..helpers import count
from ..helpers import signing as s

BROKERS = {
    "orders": {"provider": "rabbitmq", "url": "amqp://guest:pw@127.0.0.1:5672/%2F", "queue": "q"},
    "payments": {"provider": "nats", "url": "nats://127.0.0.1:4222", "stream": "PAYMENTS"},
}


@pytest.fixture
def app(make_app):
    return make_app({"sources": {**s.SOURCES, **BROKERS}})


@pytest.mark.parametrize(("name", "provider"), [("orders", "rabbitmq"), ("payments", "nats")])
def test_posting_to_a_broker_source_says_it_is_one(app, client, name, provider):
    response = client.post(f"/webhooks/{name}", json={"id": 1})
    assert response.status_code == 404
    assert response.mimetype == "application/problem+json"
    problem = response.get_json()
    assert problem["type"] == "/problems/unknown-source"
    assert problem["detail"] == (
        f"{name!r} is a broker source ({provider}): it is consumed from its broker, not posted to"
    )
    assert "not configured" not in problem["detail"]
    assert count(app) == 0


def test_an_unknown_name_is_still_not_configured(client):
    problem = client.post("/webhooks/nowhere", json={"id": 1}).get_json()
    assert problem["detail"] == "no source named 'nowhere' is configured"
