"""The NATS JetStream consumer: a durable pull consumer with explicit acks after the commit.

Each ``fetch`` takes up to ``batch`` messages (or what arrives within a
short wait); the inbox stores them in one transaction, run in a thread so
that the connection keeps answering pings, while the next batch is
fetched; only then is each message
settled: ``ack`` for a new message or a same-content duplicate; for a
conflict or a message that cannot be identified, a copy to
``dead_letter_subject`` (when set) and ``term``. The database away: every
message of the batch is ``nak``-ed with a delay and the consumer backs off.
nats-py reconnects by itself; what was not acknowledged is redelivered
after the consumer's ack wait and recognised as duplicates.

No message stops the consumer: one whose subject or headers are not exact
text (not UTF-8, a NUL, a header name nats-py would drop) would kill
nats-py's read loop or reach the inbox changed, so :class:`_Client` hands
it over with a stand-in subject, no headers and the reason, to be
dead-lettered; whatever else the library fails on while reading one
message terminates that message by its reply subject.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from typing import Any

import nats
import nats.errors
import nats.js.errors
import nats.protocol.parser
from nats.js.api import AckPolicy, ConsumerConfig

from . import batch
from .identify import MALFORMED, BrokerMessage, Unidentified
from .outage import SourceNotReady

log = logging.getLogger(__name__)

# How long one fetch waits for its batch to fill.
FETCH_WAIT_SECONDS = 0.25
# How long a first connect may try before the consumer backs off (and
# looks at its stop flag).
CONNECT_WAIT_SECONDS = 5
# How long a message whose dead-letter copy could not be published waits
# before it comes back (to be dead-lettered again).
DEAD_LETTER_RETRY_SECONDS = 5.0
DEAD_LETTER_REASON = "Dead-Letter-Reason"
# The dead letter's own Nats-Msg-Id is derived from the stream sequence, so a
# republish after a crash is dropped by JetStream's duplicate window; the
# producer's id travels in this header instead.
DEAD_LETTER_MSG_ID = "Dead-Letter-Msg-Id"
MSG_ID = "Nats-Msg-Id"
# JetStream's publish-time headers (ADR-31 and the stream's own controls).
_CONTROL_HEADER_PREFIXES = ("Nats-Expected-", "Nats-Rollup", "Nats-TTL", "Nats-Schedule")
_ERRORS = (nats.errors.Error, OSError, asyncio.TimeoutError)
# JetStream's error code for a message past its stream's max_msg_size
# (JSStreamMessageExceedsMaximumErr): published again, it is refused again.
_PAST_STREAM_MAX_MSG_SIZE = 10054
# What nats-py refuses to publish whatever the broker's state: a dead-letter
# copy refused so is never published, and its message is terminated alone.
_REFUSED = (nats.errors.BadHeaderError, nats.errors.BadSubjectError, nats.errors.MaxPayloadError)
# Messages read malformed but not yet fetched; past this, the oldest are forgotten
# (their messages are terminated, or come back, as any other).
_MAX_MALFORMED = 10_000


class _Client(nats.NATS):
    """nats-py's client, reading a message it cannot decode without dying.

    nats-py decodes a message's subject strictly: bytes that are not UTF-8
    raise in its read loop, which ends, and the source stops without a
    word. Header values that are not UTF-8 it decodes with replacement
    characters, and names that are not ASCII it drops: two different ids
    would become one. Such a message is checked here first, on the raw
    bytes, and handed on with a printable stand-in subject, no headers and
    the reason in ``malformed`` (by reply subject), for the consumer to
    dead-letter.
    """

    def __init__(self) -> None:
        super().__init__()
        self.malformed: dict[str, str] = {}
        self._ps = _Parser(self)

    def note_malformed(self, reply: bytes, reason: str) -> None:
        """Remember why the message to be settled through ``reply`` cannot be stored."""
        if len(self.malformed) >= _MAX_MALFORMED:
            self.malformed.pop(next(iter(self.malformed)))
        self.malformed[reply.decode("ascii", "backslashreplace")] = reason

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        reason = _malformed(subject, headers)
        if reason is not None:
            self.note_malformed(reply, reason)
            subject = subject.decode("utf-8", "backslashreplace").encode()
            headers = b""
        try:
            await super()._process_msg(sid, subject, reply, data, headers)
        except Exception:
            # Anything else the library cannot read: that message is
            # terminated by its reply subject, and the read loop lives on.
            log.exception("nats: a message could not be read; terminating it")
            if reply:
                await self.publish(reply.decode("ascii", "backslashreplace"), b"+TERM")


class _Parser(nats.protocol.parser.Parser):
    """nats-py's parser, reading a message line whose subject holds a vertical tab or form feed.

    The server splits a protocol line on spaces and tabs only; nats-py's
    patterns split on any white space, so such a subject fails the line
    (a protocol error: a reconnection, the message redelivered, for ever).
    The line is read here the server's way, its subject replaced by a
    stand-in and the message noted as malformed, and parsing goes on.
    """

    nc: _Client

    async def parse(self, data: bytes = b"") -> None:
        while True:
            try:
                await super().parse(data)
                return
            except nats.errors.ProtocolError:
                if not self._rescue():
                    raise
                data = b""  # what was given is in the buffer already

    def _rescue(self) -> bool:
        end = self.buf.find(b"\r\n")
        line = bytes(self.buf[:end]) if end > 0 else b""
        args = re.split(rb"[ \t]+", line)
        expected = {b"MSG": (4, 5), b"HMSG": (5, 6)}.get(args[0])
        if expected is None or len(args) not in expected or not _WHITE.search(args[1]):
            return False
        if len(args) == expected[1]:  # a reply subject: the message can be settled
            self.nc.note_malformed(args[3], "the subject holds white space")
        args[1] = _WHITE.sub(b"_", args[1])
        self.buf[:end] = b" ".join(args)
        return True


# What nats-py's patterns take for a separator but the server does not.
_WHITE = re.compile(rb"[\v\f]")


def _malformed(subject: bytes, headers: bytes) -> str | None:
    """Why a message's subject or headers cannot reach the inbox exactly, if they cannot."""
    if not subject.isascii():
        try:
            subject.decode("utf-8")
        except UnicodeDecodeError:
            return "the subject is not UTF-8 text"
    if not headers:
        return None
    if b"\x00" in headers:
        return "a header holds a NUL character"
    if headers.isascii():
        return None
    try:
        text = headers.decode("utf-8")
    except UnicodeDecodeError:
        return "a header is not UTF-8 text"
    for line in text.split("\r\n")[1:]:
        if not line.partition(":")[0].isascii():
            return "a header name is not ASCII"
    return None


# A fetched message and why it is malformed, if it is.
_Raw = tuple[Any, str | None]


class JetStreamConsumer(batch.Consumer):
    """Consume one JetStream stream (through a durable pull consumer) until ``stop`` is set."""

    source_noun = "stream"
    logger = log
    reason_field = f"{DEAD_LETTER_REASON} header"
    # No copy can ever be published: terminated alone.
    settled_without_copy = "the message is terminated"

    # Set while this consumer closes its own connection: nats-py's
    # disconnect callback then reports no outage.
    _closing = False

    def run(self) -> None:
        """Consume until stopped; reconnect and back off through outages.

        ``batch.Consumer.run``'s loop, on nats-py's event loop: the session
        and the back-off's wait are coroutines here.
        """
        asyncio.run(self._main())

    async def _main(self) -> None:
        while not self.stop.is_set():
            try:
                await self._session()
            except SourceNotReady as exc:
                await self._pause(self.not_ready.failed(exc))
            except _ERRORS as exc:
                await self._pause(self.broker.failed(self.describe(exc)))

    async def _pause(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not self.stop.is_set() and loop.time() < deadline:
            await asyncio.sleep(min(0.1, deadline - loop.time()))

    async def _session(self) -> None:
        nc = await self._connect()
        try:
            js = nc.jetstream()
            subscription = await self._subscribe(js)
            log.info(
                "source %s: consuming stream %r as %r on %s",
                self.source.name,
                self.source.stream,
                self.source.durable,
                self.source.safe_url,
            )
            self.not_ready.recovered()
            self.broker.recovered()
            await self._consume(nc, js, subscription)
        finally:
            await self._close(nc)

    async def _connect(self) -> Any:
        """Connect; raise when no server answered within CONNECT_WAIT_SECONDS or on stop.

        Once connected, nats-py reconnects by itself for as long as it
        takes, and the outage is logged once through the callbacks. Its
        first connect would retry just as long, deaf to SIGTERM: that one
        is bounded here, and the caller backs off.
        """
        self._closing = False
        last_error: list[BaseException] = []

        async def on_error(exc: Exception) -> None:
            last_error[:] = [exc]
            log.debug("source %s: nats: %s", self.source.name, exc)

        async def on_disconnected() -> None:
            if not self._closing:
                self.broker.failed("connection lost; reconnecting")

        async def on_reconnected() -> None:
            self.broker.recovered()

        options: dict[str, Any] = {
            "name": f"webhook-receiver consume {self.source.name} pid {os.getpid()}",
            "connect_timeout": 2,
            "reconnect_time_wait": 0.5,
            "max_reconnect_attempts": -1,
            "allow_reconnect": True,
            "error_cb": on_error,
            "disconnected_cb": on_disconnected,
            "reconnected_cb": on_reconnected,
        }
        nc = _Client()
        connecting = asyncio.ensure_future(nc.connect(self.source.url, **options))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_WAIT_SECONDS
        while not connecting.done() and not self.stop.is_set() and loop.time() < deadline:
            await asyncio.wait({connecting}, timeout=0.1)
        if connecting.done():
            connecting.result()  # raises what the connect raised
            return nc
        connecting.cancel()
        await self._close(nc)
        cause = f": {last_error[0]}" if last_error else ""
        raise TimeoutError(f"no NATS server answered within {CONNECT_WAIT_SECONDS} s{cause}")

    async def _close(self, nc: Any) -> None:
        self._closing = True  # our own close is no outage
        try:
            await nc.close()
        except (*_ERRORS, asyncio.CancelledError):
            pass

    async def _consume(self, nc: Any, js: Any, subscription: Any) -> None:
        # One batch is stored (and then settled) while the next one is
        # fetched; batches are settled one at a time, in order.
        inflight: asyncio.Task[None] | None = None
        try:
            while not self.stop.is_set():
                try:
                    messages = await subscription.fetch(
                        self.source.batch, timeout=FETCH_WAIT_SECONDS
                    )
                except TimeoutError:
                    # Nothing came within the wait: nats-py says so with its
                    # own TimeoutError, or a bare one once its deadline ran out
                    # (that one was taken for an outage: a reconnection and a
                    # back-off).
                    messages = []
                if inflight is not None:
                    await inflight
                    inflight = None
                if messages:
                    inflight = asyncio.create_task(self._flush(nc, js, messages))
        finally:
            # Stopping or not, the batch in hand is committed and settled first.
            if inflight is not None:
                await inflight

    async def _subscribe(self, js: Any) -> Any:
        stream, durable = self.source.stream or "", self.source.durable or ""
        try:
            await js.stream_info(stream)
        except nats.js.errors.NotFoundError as exc:
            raise SourceNotReady(
                f"stream {stream!r} does not exist on {self.source.safe_url}; "
                f"create it (flask --app wsgi brokers declare {self.source.name})"
            ) from exc
        try:
            info = await js.consumer_info(stream, durable)
        except nats.js.errors.NotFoundError:
            await js.add_consumer(
                stream,
                ConsumerConfig(
                    durable_name=durable,
                    ack_policy=AckPolicy.EXPLICIT,
                    filter_subject=self.source.filter_subject,
                    # Room for several batches in flight across competing consumers.
                    max_ack_pending=max(1000, 4 * self.source.batch),
                ),
            )
        else:
            self._check_durable(info.config)
        await self._check_dead_letter_subject(js)
        return await js.pull_subscribe_bind(durable=durable, stream=stream)

    def _check_durable(self, config: ConsumerConfig) -> None:
        """Refuse a durable made elsewhere that breaks the contract or takes other subjects."""
        problem = None
        if config.deliver_subject:
            problem = "is a push consumer; consume pulls"
        elif config.ack_policy != AckPolicy.EXPLICIT:
            # Acked on delivery, a message would be lost to a crash before the commit.
            problem = f"acknowledges {config.ack_policy}, not explicitly after the commit"
        else:
            given = [*(config.filter_subjects or []), config.filter_subject]
            filters = {subject for subject in given if subject}
            wanted = {self.source.filter_subject} if self.source.filter_subject else set()
            if filters != wanted:
                shown = ", ".join(sorted(filters)) or "nothing"
                problem = f"filters {shown}, but filter_subject is {self.source.filter_subject!r}"
        if problem:
            raise SourceNotReady(
                f"source {self.source.name}: durable consumer {self.source.durable!r} of stream "
                f"{self.source.stream!r} {problem}; delete it (nats consumer rm "
                f"{self.source.stream} {self.source.durable}) for consume to create it, "
                "or change the source's config"
            )
        if config.max_deliver is not None and config.max_deliver > 0:
            # Every nak counts (a database outage's, a dead letter's retry):
            # past the limit JetStream stops delivering a message never stored.
            log.warning(
                "source %s: durable consumer %r of stream %r has max_deliver %d: a message "
                "nak-ed that often (the database away, a dead letter not published) is "
                "never delivered again, nor stored; leave it unlimited (-1) or far above "
                "the outages to ride out",
                self.source.name,
                self.source.durable,
                self.source.stream,
                config.max_deliver,
                extra={"source": self.source.name},
            )

    async def _check_dead_letter_subject(self, js: Any) -> None:
        # Not fatal: the stream may be created later. Until then a dead letter
        # cannot be published, and its message comes back to be tried again.
        subject = self.source.dead_letter_subject
        if not subject:
            return
        try:
            await js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            log.warning(
                "source %s: no stream takes dead_letter_subject %r: dead letters come back "
                "until one does",
                self.source.name,
                subject,
                extra={"source": self.source.name},
            )

    async def _flush(self, nc: Any, js: Any, messages: list[Any]) -> None:
        own, taken = [], []
        for message in messages:
            # Our own dead letters, when the filter covers their subject:
            # settled, never stored (they would come back as conflicts).
            if message.subject == self.source.dead_letter_subject and DEAD_LETTER_REASON in (
                message.headers or {}
            ):
                own.append(message)
            else:
                taken.append(message)
        for message in own:
            await message.ack()
        # On the event loop's thread, which fills nc.malformed.
        raws = [(m, nc.malformed.pop(m.reply, None) if nc.malformed else None) for m in taken]
        try:
            verdicts = await asyncio.to_thread(self._store, raws)
        except batch.DatabaseUnavailable as exc:
            delay = self.database.failed(exc)
            for message in taken:
                await message.nak(delay=delay)
            await nc.flush()
            await self._pause(delay)
            return
        self.database.recovered()
        dead: list[batch.Verdict] = []
        retried = 0
        try:
            for message, verdict in zip(taken, verdicts, strict=True):
                if verdict.action == batch.ACK:
                    await message.ack()
                elif await self._dead_letter(js, message, verdict, nc.max_payload):
                    await message.term()
                    dead.append(verdict)
                else:
                    await message.nak(delay=DEAD_LETTER_RETRY_SECONDS)
                    retried += 1
            await nc.flush()
        finally:
            # A copy published before a lost connection is dead-lettered all
            # the same (a redelivery's copy is dropped as a duplicate).
            self.dead_lettered(dead)
        self.settled += len(messages) - retried

    def _store(self, raws: list[_Raw]) -> list[batch.Verdict]:
        return self.store_prepared(self.prepare_batch(raws, self._broker_message))

    async def _dead_letter(
        self, js: Any, message: Any, verdict: batch.Verdict, max_payload: int
    ) -> bool:
        """Publish a copy to dead_letter_subject (if set); False when that failed."""
        subject = self.source.dead_letter_subject
        if subject is None:
            return True
        # The producer's expectations and stream controls were for its own
        # publish: on the copy they would fail it (an expected last
        # sequence) or act on the dead-letter stream (a rollup, a TTL).
        headers = {
            name: value
            for name, value in (message.headers or {}).items()
            if not name.startswith(_CONTROL_HEADER_PREFIXES)
        }
        # A producer's own header of our names (a message redriven from a
        # dead-letter stream) is kept: nats-py sends a name once and reads a
        # repeated one as its last, so ours cannot go beside it.
        kept: list[str] = []
        original = headers.pop(MSG_ID, None)
        if original is not None:
            if DEAD_LETTER_MSG_ID in headers:
                kept.append(DEAD_LETTER_MSG_ID)
            else:
                headers[DEAD_LETTER_MSG_ID] = original
        with_reason = DEAD_LETTER_REASON not in headers
        if with_reason:
            headers[DEAD_LETTER_REASON] = verdict.reason or "unknown"
        else:
            kept.insert(0, DEAD_LETTER_REASON)
        sequence = message.metadata.sequence.stream
        headers[MSG_ID] = f"dead-letter:{self.source.stream}:{sequence}"
        # The server counts the headers against max_payload too (nats-py the
        # data alone): a copy past it closes the connection, for ever.
        size = _wire_size(message.data, headers)
        why_not, refused = None, False
        if size > max_payload:
            if with_reason:
                del headers[DEAD_LETTER_REASON]
            if not with_reason or _wire_size(message.data, headers) > max_payload:
                self.copy_refused(verdict, f"{size} bytes, past the server's max_payload")
                return True
            why_not = f"{size} bytes with it, past the server's max_payload"
        try:
            try:
                await js.publish(subject, message.data, headers=headers, timeout=5)
            except nats.js.errors.APIError as exc:
                # The dead-letter stream's max_msg_size (headers count) may
                # be smaller than the server's max_payload.
                if (
                    exc.err_code != _PAST_STREAM_MAX_MSG_SIZE
                    or why_not is not None
                    or not with_reason
                ):
                    raise
                del headers[DEAD_LETTER_REASON]
                why_not, refused = f"{size} bytes: {exc.description}", True
                await js.publish(subject, message.data, headers=headers, timeout=5)
        except _REFUSED as exc:
            self.copy_refused(verdict, exc)
            return True
        except _ERRORS as exc:
            if (
                isinstance(exc, nats.js.errors.APIError)
                and exc.err_code == _PAST_STREAM_MAX_MSG_SIZE
            ):
                # Without its reason too: no copy fits the dead-letter stream.
                self.copy_refused(verdict, f"{exc.description}, the dead-letter stream's limit")
                return True
            log.error(
                "source %s: could not dead-letter to %r (%s); the message is retried",
                self.source.name,
                subject,
                exc,
            )
            return False
        if why_not is not None:
            self.copy_without_reason(verdict, why_not, refused=refused)
        if kept:
            named = f" (Nats-Msg-Id {original!r})" if original is not None else ""
            self.copy_kept_own(
                verdict,
                kept,
                "header",
                "the message has its own, kept",
                f" of stream sequence {sequence}{named}",
            )
        return True

    def _broker_message(self, raw: _Raw) -> BrokerMessage:
        message, malformed = raw
        if malformed is not None:
            raise Unidentified(MALFORMED, malformed)
        headers = dict(message.headers or {})
        return BrokerMessage(
            body=message.data,
            content_type=headers.get("Content-Type"),
            headers=headers,
            subject=message.subject,
            meta={"broker": "nats", "stream": self.source.stream, "subject": message.subject},
        )


def _wire_size(data: bytes, headers: dict[str, str]) -> int:
    """A message's size as the server counts it against max_payload: headers and data."""
    lines = sum(
        len(name.strip().encode()) + len(value.strip().encode()) + 4
        for name, value in headers.items()
        if name.strip()
    )
    return len(b"NATS/1.0\r\n\r\n") + lines + len(data)
