"""Broker intakes: RabbitMQ and NATS JetStream consumers feeding the inbox.

A broker source (``[sources.<name>]`` with ``provider = "rabbitmq"`` or
``"nats"``) is consumed by ``flask --app wsgi consume``. Each batch is
stored by the inbox in one transaction (:mod:`.batch`), and only after its
commit is each message settled: acknowledged, or dead-lettered when it
conflicts with a stored message or cannot be identified. See
docs/brokers.md.
"""

from __future__ import annotations
