"""The MQTT 5 consumer: paho-mqtt's client, QoS 1 in a persistent session, PUBACK after the commit.

The source's ``client_id`` connects with clean start off and a session
expiry, and subscribes to ``topics`` with QoS 1: the broker keeps the
session's subscriptions and its messages while the consumer is away, and
sends again, on the next connection, every message it did not get a
PUBACK for. paho-mqtt's manual acknowledgement (``manual_ack=True``) sends
that PUBACK only when the consumer calls ``ack()``: after the batch's
commit. The session's Receive Maximum (three batches) bounds how many
messages the broker hands over unacknowledged.

A batch (up to ``batch`` messages, or what arrived within a short wait) is
stored by the inbox in one transaction, in a second thread, while this one
keeps the connection (keep-alives) and receives; then each message is
settled in order: acknowledged when new or a same-content duplicate; a
conflict, or a message that cannot be stored, is published to
``dead_letter_topic`` (QoS 1, its payload and properties unchanged, with
``dead-letter-reason`` and ``dead-letter-topic`` user properties) and,
once the broker has acknowledged the copy, acknowledged.

The database away: nothing is acknowledged; the batch is stored again
after the back-off (an MQTT broker sends a message again only on a new
connection). The broker away: reconnect with back-off; what was not
acknowledged comes again and is recognised as duplicates. One session is
one client id: run one consumer process per MQTT source (a second one
would take the session over).
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
from flask import Flask
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers
from paho.mqtt.subscribeoptions import SubscribeOptions

from ..config import BrokerSourceConfig, parse_broker_spec
from . import batch
from .identify import MALFORMED, BrokerMessage, Unidentified, exact_text
from .outage import Outage, SourceNotReady

log = logging.getLogger(__name__)

# How long a batch waits for more messages after its first one.
BATCH_WAIT_SECONDS = 0.05
# How long an idle consumer waits for a message before looking at the stop flag.
IDLE_WAIT_SECONDS = 0.25
# How long the broker may take to answer a CONNECT, SUBSCRIBE or dead letter.
ANSWER_SECONDS = 10.0
KEEPALIVE_SECONDS = 30
# How long the broker keeps the session (subscriptions, messages) while no
# consumer is connected.
SESSION_EXPIRY_SECONDS = 7 * 24 * 3600
DEAD_LETTER_REASON = "dead-letter-reason"
DEAD_LETTER_TOPIC = "dead-letter-topic"
# PUBACK's reason when no subscription took the message (MQTT 5, 3.4.2.1).
_NO_SUBSCRIBERS = 16
# The MQTT 5 properties of a message kept with the event (and on its dead letter).
_KEPT = {
    "PayloadFormatIndicator": "payload_format_indicator",
    "ContentType": "content_type",
    "ResponseTopic": "response_topic",
    "CorrelationData": "correlation_data",
}


class ConnectionLost(Exception):
    """The broker closed the connection, refused it, or stopped answering."""


class _Session:
    """One connection's state, filled by paho's callbacks on the consuming thread."""

    def __init__(self) -> None:
        self.connack: Any = None
        # The broker's Maximum Packet Size (CONNACK), if it says one.
        self.max_packet: int | None = None
        self.suback: list[Any] | None = None
        self.lost: str | None = None
        self.received: list[Any] = []
        # The broker's PUBACK reason for each message this client published, by mid.
        self.pubacks: dict[int, Any] = {}


class MqttConsumer(batch.Consumer):
    """Consume one MQTT source's topics (QoS 1, persistent session) until ``stop`` is set."""

    broker_errors = (ConnectionLost, OSError)
    logger = log
    reason_field = f"{DEAD_LETTER_REASON} user property"
    settled_without_copy = "the message is acknowledged"

    def __init__(self, app: Flask, source: BrokerSourceConfig, stop: threading.Event) -> None:
        super().__init__(app, source, stop)
        self.not_ready = Outage(source.name, "subscription")
        # The user properties the source's specs read: one given twice is no key.
        self._read = {
            arg
            for spec, key in ((source.dedup_key, "dedup_key"), (source.event_type, "event_type"))
            for kind, arg in [parse_broker_spec(spec, "mqtt", key)]
            if kind == "header"
        }

    # -- the connection -----------------------------------------------------------

    def _client(self, session: _Session) -> Any:
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.source.client_id or "",
            protocol=MQTTProtocolVersion.MQTTv5,
            reconnect_on_failure=False,
            manual_ack=True,
        )
        url = urlsplit(self.source.url)
        if url.username is not None:
            client.username_pw_set(
                unquote(url.username), None if url.password is None else unquote(url.password)
            )
        if url.scheme == "mqtts":
            client.tls_set_context(ssl.create_default_context())

        def on_connect(_c: Any, _u: Any, flags: Any, reason: Any, properties: Any) -> None:
            session.max_packet = getattr(properties, "MaximumPacketSize", None)
            session.connack = (flags, reason)

        def on_subscribe(_c: Any, _u: Any, _mid: int, reasons: list[Any], _p: Any) -> None:
            session.suback = reasons

        def on_publish(_c: Any, _u: Any, mid: int, reason: Any, _p: Any) -> None:
            session.pubacks[mid] = reason

        def on_disconnect(_c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
            session.lost = str(reason)

        client.on_connect = on_connect
        client.on_subscribe = on_subscribe
        client.on_disconnect = on_disconnect
        client.on_publish = on_publish
        client.on_message = lambda _c, _u, message: session.received.append(message)
        return client

    def session(self) -> None:
        session = _Session()
        client = self._client(session)
        url = urlsplit(self.source.url)
        connect = Properties(PacketTypes.CONNECT)
        connect.SessionExpiryInterval = SESSION_EXPIRY_SECONDS
        # Room for a batch being stored, one gathering and one arriving.
        connect.ReceiveMaximum = min(3 * self.source.batch, 65535)
        client.connect(
            url.hostname or "127.0.0.1",
            url.port or (8883 if url.scheme == "mqtts" else 1883),
            keepalive=KEEPALIVE_SECONDS,
            clean_start=False,
            properties=connect,
        )
        try:
            self._until(client, session, lambda: session.connack is not None, "CONNACK")
            flags, reason = session.connack
            if reason.is_failure:
                raise ConnectionLost(f"the broker refused the connection: {reason}")
            # Retain handling 1: a topic's retained message is sent to the
            # subscription when it is new, not again on every connection.
            topics = [
                (
                    topic,
                    SubscribeOptions(qos=1, retainHandling=SubscribeOptions.RETAIN_SEND_IF_NEW_SUB),
                )
                for topic in self.source.topics
            ]
            client.subscribe(topics)
            self._until(client, session, lambda: session.suback is not None, "SUBACK")
            refused = [
                f"{topic} ({code})"
                for (topic, _), code in zip(topics, session.suback or [], strict=False)
                if code.is_failure
            ]
            if refused:
                raise SourceNotReady(
                    f"the broker at {self.source.safe_url} refused the subscription to "
                    f"{', '.join(refused)}"
                )
            log.info(
                "source %s: consuming %s as %r on %s (session %s)",
                self.source.name,
                ", ".join(self.source.topics),
                self.source.client_id,
                self.source.safe_url,
                "resumed" if flags.session_present else "new",
                extra={"source": self.source.name},
            )
            self.not_ready.recovered()
            self.broker.recovered()
            self._loop(client, session)
        finally:
            if session.lost is None:
                # A clean DISCONNECT: the session and what it holds stay.
                client.disconnect()
                deadline = time.monotonic() + 1
                while session.lost is None and time.monotonic() < deadline:
                    if client.loop(0.05) != MQTTErrorCode.MQTT_ERR_SUCCESS:
                        break

    def _until(self, client: Any, session: _Session, done: Any, what: str) -> None:
        deadline = time.monotonic() + ANSWER_SECONDS
        while not done():
            self._turn(client, session, 0.05)
            if time.monotonic() > deadline:
                raise ConnectionLost(f"no {what} from {self.source.safe_url}")

    def _turn(self, client: Any, session: _Session, timeout: float) -> None:
        """Serve the connection once (keep-alive, one packet in or out); raise when it is lost."""
        rc = client.loop(timeout)
        if session.lost is not None or rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise ConnectionLost(session.lost or mqtt.error_string(rc))

    # -- batches ----------------------------------------------------------------------

    def _loop(self, client: Any, session: _Session) -> None:
        # All of paho's calls are made on this thread; the storing thread only
        # stores. Batches are settled one at a time, in the order received.
        pending = session.received
        first_at: float | None = None
        inflight: tuple[list[Any], Future[list[batch.Verdict]]] | None = None
        with ThreadPoolExecutor(1, thread_name_prefix=f"store-{self.source.name}") as pool:
            try:
                while True:
                    stopping = self.stop.is_set()
                    if inflight is not None and inflight[1].done():
                        taken, future = inflight
                        inflight = None
                        if not self._settle(client, session, taken, future):
                            first_at = None
                            continue
                    if stopping and inflight is None:
                        return  # what was received and not stored comes again
                    if pending and first_at is None:
                        first_at = time.monotonic()
                    full = len(pending) >= self.source.batch
                    waited = first_at is not None and (
                        time.monotonic() - first_at >= BATCH_WAIT_SECONDS
                    )
                    if inflight is None and pending and (full or waited) and not stopping:
                        taken = pending[: self.source.batch]
                        del pending[: self.source.batch]
                        first_at = time.monotonic() if pending else None
                        inflight = (taken, pool.submit(self._store, taken))
                        continue
                    if inflight is not None:
                        timeout = 0.002
                    elif first_at is None:
                        timeout = IDLE_WAIT_SECONDS
                    else:
                        timeout = max(0.0, first_at + BATCH_WAIT_SECONDS - time.monotonic())
                    self._turn(client, session, timeout)
            finally:
                if inflight is not None and session.lost is None:
                    # Stopping: the batch in hand is committed and settled first.
                    while not inflight[1].done() and session.lost is None:
                        client.loop(0.05)
                    if session.lost is None:
                        self._settle(client, session, *inflight)

    def _store(self, messages: list[Any]) -> list[batch.Verdict]:
        return self.store_prepared(self.prepare_batch(messages, self._broker_message))

    def _settle(
        self, client: Any, session: _Session, taken: list[Any], future: Future[list[batch.Verdict]]
    ) -> bool:
        """Settle a stored batch; False when the database was away (it goes back to pending)."""
        try:
            verdicts = future.result()
        except batch.DatabaseUnavailable as exc:
            # Nothing acknowledged: stored again, first, after the back-off.
            session.received[:0] = taken
            deadline = time.monotonic() + self.database.failed(exc)
            while not self.stop.is_set() and time.monotonic() < deadline:
                self._turn(client, session, min(0.1, max(0.0, deadline - time.monotonic())))
            return False
        self.database.recovered()
        dead = [(m, v) for m, v in zip(taken, verdicts, strict=True) if v.action != batch.ACK]
        if dead and self.source.dead_letter_topic:
            self._dead_letter(client, session, dead)
        for message in taken:
            if message.qos > 0:
                client.ack(message.mid, message.qos)
        self.dead_lettered([verdict for _, verdict in dead])
        self.settled += len(taken)
        return True

    def _dead_letter(self, client: Any, session: _Session, dead: list[tuple[Any, Any]]) -> None:
        """Publish each copy with QoS 1 and wait for the broker's PUBACK of every one."""
        topic = self.source.dead_letter_topic or ""
        sent = []
        for message, verdict in dead:
            kept = [
                *getattr(message.properties, "UserProperty", []),
                (DEAD_LETTER_TOPIC, message._topic.decode("utf-8", "replace")),
            ]
            reason = (DEAD_LETTER_REASON, verdict.reason or "unknown")
            properties = _copy_properties(message, [*kept[:-1], reason, kept[-1]])
            if not self._fits(session, topic, message.payload, properties):
                # The broker drops a connection that sends a packet past its
                # Maximum Packet Size: the original would come again, for ever.
                properties = _copy_properties(message, kept)
                if not self._fits(session, topic, message.payload, properties):
                    self.copy_refused(
                        verdict,
                        f"larger than the broker's Maximum Packet Size, {session.max_packet} bytes",
                    )
                    continue
                self.copy_without_reason(verdict, "past the broker's Maximum Packet Size with it")
            sent.append(client.publish(topic, message.payload, qos=1, properties=properties))
        deadline = time.monotonic() + ANSWER_SECONDS
        while not all(info.is_published() for info in sent):
            if time.monotonic() > deadline:
                # Not acknowledged: the originals come again on the next connection.
                raise ConnectionLost(f"no PUBACK for dead letters to {topic!r}")
            self._turn(client, session, 0.01)
        # A copy refused, or taken by no subscription (the broker then keeps
        # nothing), is not a dead letter: the originals, unacknowledged, come
        # again on the next connection.
        refused = {
            str(reason)
            for reason in (session.pubacks.pop(info.mid, None) for info in sent)
            if reason is not None and (reason.is_failure or reason.value == _NO_SUBSCRIBERS)
        }
        if refused:
            raise ConnectionLost(
                f"the broker kept no dead letter to {topic!r}: {', '.join(sorted(refused))}"
            )

    @staticmethod
    def _fits(session: _Session, topic: str, payload: bytes, properties: Any) -> bool:
        """Whether a QoS 1 PUBLISH is within the broker's Maximum Packet Size, if it has one."""
        if session.max_packet is None:
            return True
        remaining = 2 + len(topic.encode()) + 2 + len(properties.pack()) + len(payload)
        return 1 + len(VariableByteIntegers.encode(remaining)) + remaining <= session.max_packet

    # -- a message as the inbox sees it -------------------------------------------------

    def _broker_message(self, message: Any) -> BrokerMessage:
        topic = exact_text(message._topic, "the topic")
        original = message.properties
        pairs = getattr(original, "UserProperty", None) or []
        headers: dict[str, str] = {}
        for name, value in pairs:
            if name in headers:
                if name in self._read:
                    # Two values: which one is the producer's key is not for us to guess.
                    raise Unidentified(MALFORMED, f"user property {name!r} is given twice")
                headers[name] = f"{headers[name]}, {value}"
            else:
                headers[name] = value
        kept: dict[str, str | bytes] = {}
        for name, key in _KEPT.items():
            value = getattr(original, name, None)
            if value is not None:
                kept[key] = value if isinstance(value, str | bytes) else str(value)
        content_type = kept.pop("content_type", None)
        return BrokerMessage(
            body=message.payload,
            content_type=content_type if isinstance(content_type, str) else None,
            headers=headers,
            properties=kept,
            subject=topic,
            meta={
                "broker": "mqtt",
                "topic": topic,
                "qos": message.qos,
                "retain": bool(message.retain),
                "client_id": self.source.client_id,
            },
        )


def _copy_properties(message: Any, user_properties: list[tuple[str, str]]) -> Any:
    """A dead letter's PUBLISH properties: the message's kept ones and ``user_properties``."""
    properties = Properties(PacketTypes.PUBLISH)
    for name in _KEPT:
        value = getattr(message.properties, name, None)
        if value is not None:
            setattr(properties, name, value)
    # Set once: paho adds to the user properties on each assignment.
    properties.UserProperty = user_properties
    return properties
