"""The Google Cloud Pub/Sub consumer: google-cloud-pubsub's pull, acknowledge after the commit.

Each ``pull`` takes up to ``batch`` messages; the inbox stores them in one
transaction, in a second thread, while this one pulls the next batch; only
then is each message settled: acknowledged when new or a duplicate; a
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
import math
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import google.api_core.exceptions as api_exceptions
from google.cloud import pubsub_v1

from ..config import BrokerSourceConfig
from . import batch
from .identify import BrokerMessage, exact_text
from .leases import Leases
from .outage import SourceNotReady

log = logging.getLogger(__name__)

# How long one pull waits for messages; the stop flag is looked at between pulls.
PULL_WAIT_SECONDS = 1.0
# The attribute a dead letter carries its reason in.
DEAD_LETTER_REASON = "dead-letter-reason"
# How long a message whose dead-letter copy could not be published waits
# before it comes back (to be dead-lettered again).
DEAD_LETTER_RETRY_SECONDS = 5
# How long a dead letter's publish may take before it counts as failed.
PUBLISH_TIMEOUT_SECONDS = 10.0
# Ack ids per acknowledge or deadline request (each well under the request limit).
PER_REQUEST = 500
_ERRORS = (api_exceptions.GoogleAPIError, OSError)
# One received message as the client hands it over (a ReceivedMessage).
Raw = Any


class PubSubConsumer(batch.Consumer):
    """Consume one Pub/Sub subscription into the inbox until ``stop`` is set."""

    def run(self) -> None:
        """Consume until stopped; back off through outages and a missing subscription."""
        while not self.stop.is_set():
            try:
                self._session()
            except SourceNotReady as exc:
                self.stop.wait(self.not_ready.failed(exc))
            except _ERRORS as exc:
                self.stop.wait(self.broker.failed(f"{type(exc).__name__}: {exc}"))

    def _session(self) -> None:
        subscriber = pubsub_v1.SubscriberClient()
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
            leases = Leases(
                self.source.name,
                subscription.ack_deadline_seconds or 10,
                lambda raws, seconds: self._deadline(subscriber, raws, seconds),
                "ack deadline",
            )
            try:
                self._consume(subscriber, publisher, leases, exactly_once)
            finally:
                leases.close()
        finally:
            if publisher is not None:
                publisher.stop()
            subscriber.close()

    def _subscription(self, subscriber: Any) -> Any:
        try:
            return subscriber.get_subscription(subscription=self.source.subscription, timeout=10)
        except api_exceptions.NotFound as exc:
            raise SourceNotReady(
                f"subscription {self.source.subscription!r} does not exist; "
                f"create it (flask --app wsgi brokers declare {self.source.name})"
            ) from exc

    def _consume(self, subscriber: Any, publisher: Any, leases: Leases, exactly_once: bool) -> None:
        # This thread pulls a batch while a second stores and settles the one
        # before it; batches are settled one at a time, in order.
        inflight: Future[None] | None = None
        with ThreadPoolExecutor(1, thread_name_prefix=f"store-{self.source.name}") as pool:
            try:
                while not self.stop.is_set():
                    since = time.monotonic()
                    raws = self._pull(subscriber)
                    ticket = leases.hold(raws, since) if raws else None
                    if inflight is not None:
                        inflight.result()
                        inflight = None
                    if ticket is not None:
                        inflight = pool.submit(
                            self._flush, subscriber, publisher, leases, raws, ticket, exactly_once
                        )
            finally:
                # Stopping or not, the batch in hand is committed and settled first.
                if inflight is not None:
                    inflight.result()

    def _pull(self, subscriber: Any) -> list[Raw]:
        try:
            response = subscriber.pull(
                subscription=self.source.subscription,
                max_messages=self.source.batch,
                timeout=PULL_WAIT_SECONDS,
                retry=None,
            )
        except api_exceptions.DeadlineExceeded:
            return []  # nothing came within the wait
        return list(response.received_messages)

    def _flush(
        self,
        subscriber: Any,
        publisher: Any,
        leases: Leases,
        raws: list[Raw],
        ticket: int,
        exactly_once: bool,
    ) -> None:
        try:
            prepared = self.prepare(self.source, raws, _reader_of(self.source))
            with self.app.app_context():
                verdicts = self.store(self.source, prepared)
        except batch.DatabaseUnavailable as exc:
            # Nothing committed, nothing acknowledged: the batch comes back
            # once the back-off has passed.
            delay = self.database.failed(exc)
            leases.release(ticket)
            self._deadline(subscriber, raws, max(1, math.ceil(delay)))
            self.stop.wait(delay)
            return
        except BaseException:
            leases.release(ticket)
            raise
        self.database.recovered()
        try:
            self._settle(subscriber, publisher, raws, verdicts, exactly_once)
        finally:
            leases.release(ticket)

    def _settle(
        self,
        subscriber: Any,
        publisher: Any,
        raws: list[Raw],
        verdicts: list[batch.Verdict],
        exactly_once: bool,
    ) -> None:
        done: list[Raw] = []
        dead: list[tuple[Raw, batch.Verdict]] = []
        given_back: list[Raw] = []
        for raw, verdict in zip(raws, verdicts, strict=True):
            if verdict.action == batch.ACK:
                done.append(raw)
            elif publisher is not None:
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
        sent, failed = self._dead_letter(publisher, dead)
        try:
            self._acknowledge(subscriber, done + [raw for raw, _ in sent], exactly_once)
        finally:
            # Those published before a lost connection are dead-lettered all the same.
            self.dead_lettered([verdict for _, verdict in sent])
        if given_back:
            self._deadline(subscriber, given_back, 0)
        if failed:
            self._deadline(subscriber, failed, DEAD_LETTER_RETRY_SECONDS)
        self.settled += len(raws) - len(failed) - len(given_back)

    def _acknowledge(self, subscriber: Any, raws: Sequence[Raw], exactly_once: bool) -> None:
        for start in range(0, len(raws), PER_REQUEST):
            ack_ids = [raw.ack_id for raw in raws[start : start + PER_REQUEST]]
            try:
                subscriber.acknowledge(subscription=self.source.subscription, ack_ids=ack_ids)
            except api_exceptions.GoogleAPICallError as exc:
                if not exactly_once:
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

    def _deadline(self, subscriber: Any, raws: Sequence[Raw], seconds: int) -> None:
        for start in range(0, len(raws), PER_REQUEST):
            subscriber.modify_ack_deadline(
                subscription=self.source.subscription,
                ack_ids=[raw.ack_id for raw in raws[start : start + PER_REQUEST]],
                ack_deadline_seconds=seconds,
            )

    def _dead_letter(
        self, publisher: Any, dead: list[tuple[Raw, batch.Verdict]]
    ) -> tuple[list[tuple[Raw, batch.Verdict]], list[Raw]]:
        """Publish copies to dead_letter_topic: (those confirmed, those whose copy failed)."""
        if not dead:
            return [], []
        topic = self.source.dead_letter_topic
        futures = []
        for raw, verdict in dead:
            attributes = dict(raw.message.attributes)
            attributes[DEAD_LETTER_REASON] = verdict.reason or "unknown"
            futures.append(publisher.publish(topic, raw.message.data, **attributes))
        sent: list[tuple[Raw, batch.Verdict]] = []
        failed: list[Raw] = []
        for (raw, verdict), future in zip(dead, futures, strict=True):
            try:
                future.result(timeout=PUBLISH_TIMEOUT_SECONDS)
            except Exception as exc:  # a publish future raises whatever failed it
                log.error(
                    "source %s: could not dead-letter to %r (%s: %s); the message is retried",
                    self.source.name,
                    topic,
                    type(exc).__name__,
                    exc,
                    extra={"source": self.source.name},
                )
                failed.append(raw)
            else:
                sent.append((raw, verdict))
        return sent, failed


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
            "publish_time": message.publish_time.isoformat(),
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
