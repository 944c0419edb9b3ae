"""What a broker forward publishes, and how a publish fails."""

from __future__ import annotations

from dataclasses import dataclass, field


class PublishError(Exception):
    """A publish was not confirmed; the delivery is retried."""


class PublishRefused(PublishError):
    """The message cannot be published as configured (whatever the attempt): not retried."""


@dataclass(frozen=True)
class BrokerMessage:
    """What a broker forward publishes for one event."""

    body: bytes
    content_type: str | None
    message_id: str
    correlation_id: str
    event_type: str | None
    # Extra headers (AMQP headers table, NATS headers): source, event id.
    headers: dict[str, str] = field(default_factory=dict)
