"""The Google Cloud Pub/Sub consumer: google-cloud-pubsub's pull, acknowledge after the commit.

A batch is up to ``batch`` messages, pulled while each pull comes back at
least half full; the inbox stores it in one transaction, and only then is
each message settled (:mod:`.pulled`: receiving, storing and settling
overlap, a thread each): acknowledged when new or a duplicate; a
conflict or a message that cannot be stored is published to
``dead_letter_topic`` (data and attributes unchanged, plus a
``dead-letter-reason`` attribute) and, once the publish is confirmed,
acknowledged, or, without one, nacked (its ack deadline set to 0) for the
subscription's own dead-letter policy to count. With exactly-once delivery
on the subscription, an acknowledgement's result is checked, and a failed
one is logged (the message comes back and is recognised as a duplicate).
Every message in hand has its ack deadline extended past half its length
(:mod:`.leases`), so a long batch never lets it be redelivered. The
database away: the batch's deadline is set to the back-off, nothing is
acknowledged, and the consumer waits. The emulator is reached through
``PUBSUB_EMULATOR_HOST``, as the client library does by itself.

The pull is the synchronous one (``SubscriberClient.pull``), not the
streaming pull: the consumer decides when a message is acknowledged or
given back, and with whatever deadline, and the library's lease manager
would extend the messages a killed consumer held for up to its own
maximum before they came back.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import UTC
from typing import Any

import google.api_core.exceptions as api_exceptions
import google.auth.exceptions
from google.cloud import pubsub_v1
from google.pubsub_v1.services.publisher import PublisherClient as ApiPublisher

from ..config import BrokerSourceConfig
from . import batch
from .identify import BrokerMessage, exact_text
from .leases import Leases
from .outage import SourceNotReady
from .pulled import PulledConsumer

log = logging.getLogger(__name__)

# How long one pull waits for messages; the stop flag is looked at between pulls.
PULL_WAIT_SECONDS = 1.0
# How long a pull that fills a batch up waits (a backlog answers at once).
FOLLOW_UP_WAIT_SECONDS = 0.2
# The attribute a dead letter carries its reason in, and Pub/Sub's most per message.
DEAD_LETTER_REASON = "dead-letter-reason"
MAX_ATTRIBUTES = 100
# How long a message whose dead-letter copy could not be published waits
# before it comes back (to be dead-lettered again).
DEAD_LETTER_RETRY_SECONDS = 5
# How long a dead letter's publish may take before it counts as failed.
PUBLISH_TIMEOUT_SECONDS = 10.0
# Ack ids per acknowledge or deadline request (each well under the request limit).
PER_REQUEST = 500
_ERRORS = (api_exceptions.GoogleAPIError, OSError)
# One received message, as its protocol buffer (google.pubsub.v1.ReceivedMessage).
Raw = Any


class PubSubConsumer(PulledConsumer):
    """Consume one Pub/Sub subscription into the inbox until ``stop`` is set."""

    broker_errors = _ERRORS
    source_noun = "subscription"
    logger = log
    reason_field = f"{DEAD_LETTER_REASON} attribute"
    settled_without_copy = "the message is acknowledged"

    # The session's clients (thread-safe: the three stages share them), and
    # whether the subscription delivers exactly once.
    _subscriber: Any = None
    _publisher: Any = None
    _exactly_once = False

    def session(self) -> None:
        try:
            # The client looks for credentials when made: none (no emulator,
            # no application default credentials) is the source's to wait
            # for, said once, not a consumer's failure with a traceback.
            subscriber = pubsub_v1.SubscriberClient()
        except google.auth.exceptions.GoogleAuthError as exc:
            raise SourceNotReady(f"Pub/Sub: no credentials: {exc}") from exc
        publisher: Any = None
        try:
            subscription = self._subscription(subscriber)
            exactly_once = bool(subscription.enable_exactly_once_delivery)
            policy = subscription.dead_letter_policy.dead_letter_topic
            if not self.source.dead_letter_topic and not policy:
                log.warning(
                    "source %s: subscription %r has no dead-letter policy and the source no "
                    "dead_letter_topic: conflicts and poison messages come back, for ever",
                    self.source.name,
                    self.source.subscription,
                    extra={"source": self.source.name},
                )
            if self.source.dead_letter_topic:
                publisher = pubsub_v1.PublisherClient()
            log.info(
                "source %s: consuming subscription %r",
                self.source.name,
                self.source.subscription,
            )
            self.not_ready.recovered()
            self.broker.recovered()
            self._subscriber, self._publisher = subscriber, publisher
            self._exactly_once = exactly_once
            deadline = subscription.ack_deadline_seconds or 10
            leases = Leases(self.source.name, deadline, self.give_back, "ack deadline")
            try:
                self.pipeline(leases)
            finally:
                leases.close()
        finally:
            if publisher is not None:
                publisher.stop()
            subscriber.close()

    def _subscription(self, subscriber: Any) -> Any:
        try:
            return subscriber.get_subscription(subscription=self.source.subscription, timeout=10)
        except google.auth.exceptions.GoogleAuthError as exc:
            # Credentials found but refused (revoked, expired, a key file
            # that is not one): as above.
            raise SourceNotReady(f"Pub/Sub: credentials refused: {exc}") from exc
        except api_exceptions.NotFound as exc:
            raise SourceNotReady(
                f"subscription {self.source.subscription!r} does not exist; "
                f"create it (flask --app wsgi brokers declare {self.source.name})"
            ) from exc

    def receive(self) -> list[Raw]:
        """Up to ``batch`` messages: pulls while each comes back at least half full."""
        raws: list[Raw] = []
        wait = PULL_WAIT_SECONDS
        while len(raws) < self.source.batch:
            want = self.source.batch - len(raws)
            try:
                response = self._subscriber.pull(
                    subscription=self.source.subscription,
                    max_messages=want,
                    timeout=wait,
                    retry=None,
                )
            except api_exceptions.DeadlineExceeded:
                break  # nothing (more) came within the wait
            # The protocol buffers themselves: proto-plus's wrappers cost more
            # to read than the rest of a message's identification.
            got = type(response).pb(response).received_messages
            raws += got
            # A pull may return fewer than asked with more waiting (the
            # emulator returns at most 100): a half-full one suggests a backlog.
            if len(got) * 2 < want or self.stop.is_set():
                break
            wait = FOLLOW_UP_WAIT_SECONDS
        return raws

    def give_back(self, raws: Sequence[Raw], seconds: int) -> None:
        """Let Pub/Sub redeliver ``raws`` in ``seconds`` (their ack deadline from now)."""
        for start in range(0, len(raws), PER_REQUEST):
            self._subscriber.modify_ack_deadline(
                subscription=self.source.subscription,
                ack_ids=[raw.ack_id for raw in raws[start : start + PER_REQUEST]],
                ack_deadline_seconds=seconds,
            )

    def reader(self) -> Any:
        """The function that turns one of the source's messages into a BrokerMessage."""
        return _reader_of(self.source)

    def settle(self, raws: list[Raw], verdicts: list[batch.Verdict]) -> None:
        """Acknowledge the stored messages; dead-letter (or nack) the others."""
        done: list[Raw] = []
        dead: list[tuple[Raw, batch.Verdict]] = []
        given_back: list[Raw] = []
        for raw, verdict in zip(raws, verdicts, strict=True):
            if verdict.action == batch.ACK:
                done.append(raw)
            elif self._publisher is not None:
                dead.append((raw, verdict))
            else:
                given_back.append(raw)
                log.warning(
                    "source %s: message not stored (%s: %s); nacked for the subscription's "
                    "dead-letter policy",
                    self.source.name,
                    verdict.reason,
                    verdict.detail,
                    extra={"source": self.source.name, "reason": verdict.reason},
                )
        sent, failed = self._dead_letter(dead)
        try:
            self._acknowledge(done + [raw for raw, _ in sent])
        finally:
            # Those published before a lost connection are dead-lettered all the same.
            self.dead_lettered([verdict for _, verdict in sent])
        if given_back:
            self.give_back(given_back, 0)
        if failed:
            self.give_back(failed, DEAD_LETTER_RETRY_SECONDS)
        self.settled += len(raws) - len(failed) - len(given_back)

    def _acknowledge(self, raws: Sequence[Raw]) -> None:
        for start in range(0, len(raws), PER_REQUEST):
            ack_ids = [raw.ack_id for raw in raws[start : start + PER_REQUEST]]
            try:
                self._subscriber.acknowledge(subscription=self.source.subscription, ack_ids=ack_ids)
            except api_exceptions.GoogleAPICallError as exc:
                if not self._exactly_once:
                    raise
                # Exactly-once delivery says which acks failed (an expired ack
                # id): those messages come back and are duplicates then.
                log.warning(
                    "source %s: %d acknowledgements failed (%s); the messages will come back "
                    "and be recognised as duplicates",
                    self.source.name,
                    len(ack_ids),
                    exc,
                    extra={"source": self.source.name},
                )

    def _dead_letter(
        self, dead: list[tuple[Raw, batch.Verdict]]
    ) -> tuple[list[tuple[Raw, batch.Verdict]], list[Raw]]:
        """Publish copies to dead_letter_topic: (those confirmed, those whose copy failed)."""
        if not dead:
            return [], []
        topic = self.source.dead_letter_topic
        assert topic is not None  # a publisher is made only for a dead_letter_topic
        sent: list[tuple[Raw, batch.Verdict]] = []
        failed: list[Raw] = []
        for raw, verdict in dead:
            if self._copy_out(topic, raw, verdict):
                sent.append((raw, verdict))
            else:
                failed.append(raw)
        return sent, failed

    def _copy_out(self, topic: str, raw: Raw, verdict: batch.Verdict) -> bool:
        """Publish one message's copy; False when it is to be tried again.

        The reason goes in an attribute when one more fits (Pub/Sub takes
        100) and the message has none of that name. A copy Pub/Sub refuses
        as invalid (too large: the attribute counts too) is published again
        without it; refused still, it is never published, and the message
        is settled without one.
        """
        message = raw.message
        attributes = dict(message.attributes)
        reason = verdict.reason or "unknown"
        why_not = _no_room(attributes)
        if why_not is None:
            attributes[DEAD_LETTER_REASON] = reason
        try:
            try:
                self._publish(topic, message.data, attributes)
            except api_exceptions.InvalidArgument as exc:
                if why_not is not None:
                    raise
                why_not = f"refused with it: {exc.message}"
                self._publish(topic, message.data, message.attributes)
        except api_exceptions.InvalidArgument as exc:
            # No copy can ever be published: acknowledged without one.
            self.copy_refused(verdict, exc.message, f" of message {message.message_id}")
            return True
        except Exception as exc:  # the call raises whatever failed it
            log.error(
                "source %s: could not dead-letter to %r (%s: %s); the message is retried",
                self.source.name,
                topic,
                type(exc).__name__,
                exc,
                extra={"source": self.source.name},
            )
            return False
        if why_not is not None:
            self.copy_without_reason(verdict, why_not, f" of message {message.message_id}")
        return True

    def _publish(self, topic: str, data: bytes, attributes: Mapping[str, str]) -> None:
        publish_exactly(self._publisher, topic, data, attributes, PUBLISH_TIMEOUT_SECONDS)


def _no_room(attributes: Mapping[str, str]) -> str | None:
    """Why a copy cannot carry the reason attribute, or None when it can."""
    if DEAD_LETTER_REASON in attributes:
        return "the message has one of its own, kept"
    if len(attributes) >= MAX_ATTRIBUTES:
        return f"the message has Pub/Sub's most of {MAX_ATTRIBUTES} attributes"
    return None


def publish_exactly(
    publisher: Any, topic: str, data: bytes, attributes: Mapping[str, str], timeout: float
) -> str:
    """Publish one message whatever its attributes' names; its message id once confirmed.

    The client's ``publish()`` takes attributes as keyword arguments beside
    its own (``topic``, ``data``, ``ordering_key``, ``retry``, ``timeout``): a
    message with an attribute of one of those names would fail it, or have
    the attribute taken for a setting. The API's publish takes the message.
    """
    message = pubsub_v1.types.PubsubMessage(data=data, attributes=dict(attributes))
    # The generated API client's publish, which the batching client extends.
    response = ApiPublisher.publish(publisher, topic=topic, messages=[message], timeout=timeout)
    return str(response.message_ids[0])


def _reader_of(source: BrokerSourceConfig) -> Any:
    """The function that turns one of ``source``'s received messages into a BrokerMessage."""

    def read(raw: Raw) -> BrokerMessage:
        message = raw.message
        # Protocol buffer strings: UTF-8 always, but a NUL no database text holds.
        attributes = {
            exact_text(name, "an attribute name"): exact_text(value, f"attribute {name!r}")
            for name, value in message.attributes.items()
        }
        content_type = next((v for k, v in attributes.items() if k.lower() == "content-type"), None)
        meta: dict[str, Any] = {
            "broker": "pubsub",
            "subscription": source.subscription,
            "message_id": message.message_id,
            "publish_time": message.publish_time.ToDatetime(UTC).isoformat(),
        }
        if message.ordering_key:
            meta["ordering_key"] = message.ordering_key
        return BrokerMessage(
            body=message.data,
            content_type=content_type,
            headers=attributes,
            properties={"message_id": message.message_id},
            meta=meta,
        )

    return read
