"""A valid delivery for each test source of ``signing.SOURCES``, with the key given."""

from __future__ import annotations

from . import signing as s


def delivery_for(source: str, key: str) -> tuple[bytes, dict[str, str]]:
    """A correctly signed delivery to one of the test sources, under ``key``."""
    if source == "stripe-live":
        return s.stripe_delivery({"id": key, "type": "invoice.paid"})
    if source == "github":
        return s.github_delivery({"action": "opened"}, delivery=key)
    if source == "svix":
        return s.standard_delivery({"type": "x"}, msg_id=key)
    if source == "shop":
        return s.shopify_delivery({"id": 1}, webhook_id=key)
    if source == "slack":
        return s.slack_delivery({"type": "event_callback", "event_id": key})
    if source == "gitlab":
        return s.dumps({"object_kind": "push"}), {
            "X-Gitlab-Token": s.GITLAB_SECRET,
            "X-Gitlab-Event-UUID": key,
            "Content-Type": "application/json",
        }
    if source == "ce":
        body = s.dumps({"key": key})
        return body, {
            "X-Signature": s.hmac_hex(body),
            "ce-id": key,
            "ce-source": "/test",
            "ce-type": "t",
            "ce-specversion": "1.0",
            "Content-Type": "application/json",
        }
    if source == "generic-json":
        body = s.dumps({"meta": {"delivery": key}})
        return body, {"X-Hub-Signature": s.hmac_hex(body), "Content-Type": "application/json"}
    if source == "paddle":
        return s.paddle_delivery(
            {"notification_id": key, "event_id": "evt_1", "event_type": "transaction.created"}
        )
    raise AssertionError(f"no delivery builder for source {source}")
