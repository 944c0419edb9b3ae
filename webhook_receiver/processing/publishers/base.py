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

    def attributes(self) -> dict[str, str]:
        """Everything but the body as named text values, none empty (SQS's and Pub/Sub's form)."""
        values = {
            "message-id": self.message_id,
            "type": self.event_type or "",
            "content-type": self.content_type or "",
            "X-Request-Id": self.correlation_id,
            **self.headers,
        }
        return {name: value for name, value in values.items() if value}

    def headers_named(self, message_id: str, content_type: str, event_type: str) -> dict[str, str]:
        """The id, content type, correlation id, extra headers, then the type if any.

        Under the names the broker's consumers read (NATS and Kafka name
        them differently); an unknown content type is sent as octet-stream.
        """
        headers = {
            message_id: self.message_id,
            content_type: self.content_type or "application/octet-stream",
            "X-Request-Id": self.correlation_id,
            **self.headers,
        }
        if self.event_type:
            headers[event_type] = self.event_type
        return headers
