"""Identifying a broker message: what of it is stored, with no broker or database involved."""

from __future__ import annotations

from webhook_receiver.brokers.identify import Delivery, identify
from webhook_receiver.config import BrokerSourceConfig

SOURCE = BrokerSourceConfig(
    name="orders",
    provider="rabbitmq",
    url="amqp://guest:guest@127.0.0.1:5672/%2F",
    dedup_key="property:message_id",
    event_type="property:type",
    batch=10,
    queue="orders",
)


def _delivery(**fields: object) -> Delivery:
    values: dict[str, object] = {
        "body": b'{"id": "evt-1"}',
        "content_type": "application/json",
        "properties": {"message_id": "evt-1", "type": "order.paid"},
        "meta": {"broker": "rabbitmq", "queue": "orders", "routing_key": "orders"},
    }
    values.update(fields)
    return Delivery(**values)  # type: ignore[arg-type]


def test_meta_holds_where_it_came_from_and_the_producers_properties():
    message = identify(SOURCE, _delivery())
    assert message.meta == {
        "broker": "rabbitmq",
        "queue": "orders",
        "routing_key": "orders",
        "properties": {"message_id": "evt-1", "type": "order.paid"},
    }


def test_a_nul_in_meta_or_a_header_is_replaced_as_jsonb_cannot_hold_it():
    delivery = _delivery(
        properties={"message_id": "evt-1", "type": "order.paid", "app_id": "a\x00b"},
        meta={"broker": "rabbitmq", "nested": [{"k\x00": 1}], "n": 2.5, "flag": None},
        headers={"X-Trace": "t\x00"},
    )
    message = identify(SOURCE, delivery)
    assert message.meta == {
        "broker": "rabbitmq",
        "nested": [{"k\ufffd": 1}],
        "n": 2.5,
        "flag": None,
        "properties": {"message_id": "evt-1", "type": "order.paid", "app_id": "a\ufffdb"},
    }
    assert message.headers == (("X-Trace", "t\ufffd"),)
