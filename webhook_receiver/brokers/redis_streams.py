"""The Redis Streams consumer: a consumer group read with XREADGROUP, XACK after the commit.

Each process reads as a consumer of its own name (host, pid and a random
tag) in the source's group, created (with the stream, ``MKSTREAM``) when
absent, from the stream's start. A batch of up to ``batch`` entries is
stored by the inbox in one transaction, in a second thread, while this one
reads the next; only then is each entry settled: ``XACK`` for a new entry
or a same-content duplicate; for a conflict or an entry that cannot be
stored, a copy to ``dead_letter_stream`` (its fields unchanged, with
``dead_letter_reason``, ``dead_letter_id`` and ``dead_letter_stream``
fields where it has none of its own) and ``XACK`` in one
``MULTI``/``EXEC``, so that a crash never leaves one without the other.

What a consumer read and never acknowledged stays pending in the group
under its name. On start, and every ``claim_idle_seconds``, ``XAUTOCLAIM``
takes the entries pending longer than that from any consumer (one killed,
or gone): a killed process's batch is stored by another, or by itself
started again. An entry claimed after more than ``max_deliveries``
deliveries is poison (it failed every consumer that read it): it is
dead-lettered as ``max-deliveries``, never stored.

The database away: nothing is acknowledged; the batch is held in memory
and stored again after the back-off (not read again, which would count
deliveries). While a batch is stored, or held, its entries' idle time is
reset every third of ``claim_idle_seconds`` (``XCLAIM ... JUSTID``, which
counts no delivery), so that no other consumer claims them from a consumer
that is alive. The server away:
reconnect with back-off, then read this consumer's own pending entries
first (``XREADGROUP`` from id 0).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, NamedTuple

import orjson
import redis
import redis.exceptions
from flask import Flask

from ..config import BrokerSourceConfig
from . import batch
from .identify import PAYLOAD_INVALID, BrokerMessage, Unidentified, binary_text, exact_text
from .outage import Outage, SourceNotReady

log = logging.getLogger(__name__)

# How long an idle read waits for entries before looking at the stop flag.
BLOCK_MILLISECONDS = 250
# How long a connection, or a reply, may take before the server is taken for away.
CONNECT_SECONDS = 5.0
REPLY_SECONDS = 10.0
# A consumer of the group with nothing pending and idle this long is gone
# (a process that ended without removing it): removed from the group.
GONE_CONSUMER_SECONDS = 3600
# An entry delivered more often than the source's max_deliveries.
MAX_DELIVERIES = "max-deliveries"
# The fields a dead letter carries besides the entry's own.
DEAD_LETTER_REASON = b"dead_letter_reason"
DEAD_LETTER_ID = b"dead_letter_id"
DEAD_LETTER_STREAM = b"dead_letter_stream"
_DEAD_LETTER_FIELDS = (DEAD_LETTER_REASON, DEAD_LETTER_ID, DEAD_LETTER_STREAM)
_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class Entry(NamedTuple):
    """A stream entry as read: its id, its fields (None: deleted from the stream), deliveries."""

    id: bytes
    fields: dict[bytes, bytes] | None
    # How often the group delivered it, this time included (0: not known).
    deliveries: int = 1


def consumer_name() -> str:
    """This process's consumer name in a group: host, pid and a tag of its own."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class RedisStreamConsumer(batch.Consumer):
    """Consume one Redis stream, as one consumer of the source's group, until ``stop`` is set."""

    broker_errors = _ERRORS
    source_noun = "stream"
    logger = log
    reason_field = f"{DEAD_LETTER_REASON.decode()} field"

    def __init__(self, app: Flask, source: BrokerSourceConfig, stop: threading.Event) -> None:
        super().__init__(app, source, stop)
        self.not_ready = Outage(source.name, "stream")
        self.name = consumer_name()
        self.stream = source.stream or ""
        self.group = source.group_id or ""
        # Batches read but not stored (the database was away): stored first.
        self._held: list[list[Entry]] = []
        # Where this consumer's own pending entries are read from, after a
        # (re)connection; None once they are all read.
        self._history: bytes | None = None
        # Where the claim pass goes on from, and when the next one starts.
        self._claim_from: bytes = b"0-0"
        self._claim_at = 0.0

    def session(self) -> None:
        client = redis.Redis.from_url(
            self.source.url,
            socket_connect_timeout=CONNECT_SECONDS,
            socket_timeout=REPLY_SECONDS,
            client_name=f"webhook-receiver-consume-{self.source.name}-{os.getpid()}",
        )
        try:
            self._ensure_group(client)
            log.info(
                "source %s: consuming stream %r as %r of group %r on %s",
                self.source.name,
                self.stream,
                self.name,
                self.group,
                self.source.safe_url,
                extra={"source": self.source.name},
            )
            self.not_ready.recovered()
            self.broker.recovered()
            # What was held is pending under this name: read again from there.
            self._held.clear()
            self._history = b"0"
            self._claim_from, self._claim_at = b"0-0", 0.0
            self._loop(client)
            self._leave(client)
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" in str(exc):
                # Deleted while consuming: created again by the next session.
                raise SourceNotReady(
                    f"group {self.group!r} of stream {self.stream!r}: {exc}"
                ) from exc
            raise
        finally:
            client.close()

    def _ensure_group(self, client: Any) -> None:
        """Create the group (and the stream) when absent, reading from the stream's start."""
        try:
            client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
            log.info(
                "source %s: created group %r of stream %r",
                self.source.name,
                self.group,
                self.stream,
                extra={"source": self.source.name},
            )
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" in str(exc):
                return  # it exists
            if "WRONGTYPE" in str(exc):
                raise SourceNotReady(
                    f"key {self.stream!r} on {self.source.safe_url} is not a stream"
                ) from exc
            raise

    def _leave(self, client: Any) -> None:
        """Stopping cleanly: remove this consumer from the group, if nothing is pending with it."""
        mine = client.xpending_range(self.stream, self.group, "-", "+", 1, consumername=self.name)
        if not mine:
            client.xgroup_delconsumer(self.stream, self.group, self.name)

    # -- reading ----------------------------------------------------------------

    def _loop(self, client: Any) -> None:
        # One batch is stored (then settled) while the next is read and
        # identified; batches are settled one at a time, in order, on this
        # thread, which owns the connection.
        inflight: tuple[list[Entry], Future[list[batch.Verdict]]] | None = None
        with ThreadPoolExecutor(1, thread_name_prefix=f"store-{self.source.name}") as pool:
            try:
                while not self.stop.is_set():
                    entries = self._next(client, wait=inflight is None)
                    # Identified here, while the batch before is stored.
                    prepared = self.prepare_batch(entries, self._broker_message)
                    if inflight is not None:
                        stored = self._settle(client, *inflight, arrived=entries)
                        inflight = None
                        if not stored:
                            continue  # held, with what arrived: stored again first
                    if entries:
                        inflight = (entries, pool.submit(self.store_prepared, prepared))
            finally:
                # Stopping or not, the batch in hand is committed and settled first.
                if inflight is not None:
                    self._settle(client, *inflight, arrived=[])

    def _next(self, client: Any, *, wait: bool) -> list[Entry]:
        """The next batch: held, then own pending, then claimed, then new entries."""
        if self._held:
            return self._held.pop(0)
        if self._history is not None:
            return self._read_history(client)
        if time.monotonic() >= self._claim_at:
            return self._claim(client)
        reply = client.xreadgroup(
            self.group,
            self.name,
            {self.stream: ">"},
            count=self.source.batch,
            block=BLOCK_MILLISECONDS if wait else None,
        )
        return [Entry(i, f) for _, entries in reply or [] for i, f in entries]

    def _read_history(self, client: Any) -> list[Entry]:
        assert self._history is not None
        reply = client.xreadgroup(
            self.group, self.name, {self.stream: self._history}, count=self.source.batch
        )
        # An entry deleted from the stream since it was read comes back with
        # no fields (redis-py makes its nil an empty dict): None, as such.
        entries = [Entry(i, f or None, 0) for _, found in reply or [] for i, f in found]
        if not entries:
            self._history = None
            return []
        self._history = entries[-1].id
        return entries

    def _claim(self, client: Any) -> list[Entry]:
        """One page of entries pending longer than claim_idle_seconds, claimed (XAUTOCLAIM)."""
        idle_ms = self.source.claim_idle_seconds * 1000
        reply = client.xautoclaim(
            self.stream,
            self.group,
            self.name,
            idle_ms,
            start_id=self._claim_from,
            count=self.source.batch,
        )
        cursor, claimed = reply[0], reply[1]
        if cursor in (b"0-0", "0-0"):
            # The pass is over: the next one after claim_idle_seconds.
            self._claim_from = b"0-0"
            self._claim_at = time.monotonic() + self.source.claim_idle_seconds
            self._forget_gone(client)
        else:
            self._claim_from = cursor
        if not claimed:
            return []
        entries = [Entry(i, f, 0) for i, f in claimed]
        # How often each was delivered, this claim included.
        counts = {
            row["message_id"]: row["times_delivered"]
            for row in client.xpending_range(
                self.stream,
                self.group,
                entries[0].id,
                entries[-1].id,
                len(entries) + 2 * self.source.batch,
                consumername=self.name,
            )
        }
        log.info(
            "source %s: claimed %d entries left pending by other consumers",
            self.source.name,
            len(entries),
            extra={"source": self.source.name},
        )
        return [entry._replace(deliveries=counts.get(entry.id, 0)) for entry in entries]

    def _forget_gone(self, client: Any) -> None:
        """Remove consumers long idle with nothing pending: processes that ended uncleanly."""
        for consumer in client.xinfo_consumers(self.stream, self.group):
            name = consumer["name"]
            name = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
            idle = consumer.get("inactive", consumer.get("idle", 0))
            if (
                name != self.name
                and consumer["pending"] == 0
                and idle > GONE_CONSUMER_SECONDS * 1000
            ):
                client.xgroup_delconsumer(self.stream, self.group, name)

    # -- storing and settling ---------------------------------------------------------

    def _settle(
        self,
        client: Any,
        entries: list[Entry],
        future: Future[list[batch.Verdict]],
        arrived: list[Entry],
    ) -> bool:
        """Settle a stored batch; False when the database was away (held, with ``arrived``)."""
        # While it is stored, its entries (and those read behind it) are kept
        # from being claimed: a database that stalls is not a dead consumer.
        mine = [entry.id for entry in (*entries, *arrived)]
        while not wait([future], timeout=self._touch_every).done:
            self._touch(client, mine)
        try:
            verdicts = future.result()
        except batch.DatabaseUnavailable as exc:
            self._held = [entries, *([arrived] if arrived else []), *self._held]
            self._hold(client, self.database.failed(exc))
            return False
        self.database.recovered()
        dead = [(e, v) for e, v in zip(entries, verdicts, strict=True) if v.action != batch.ACK]
        target = self.source.dead_letter_stream
        if target and any(entry.fields is not None for entry, _ in dead):
            kind = client.type(target)
            if kind not in (b"none", b"stream", "none", "stream"):
                # In the MULTI/EXEC a copy's XADD would fail alone (WRONGTYPE)
                # and the XACK beside it go through: the entry lost. Only the
                # stored entries are acknowledged; the others come again from
                # this consumer's pending entries in the next session.
                stored = [
                    e.id for e, v in zip(entries, verdicts, strict=True) if v.action == batch.ACK
                ]
                if stored:
                    client.xack(self.stream, self.group, *stored)
                shown = kind.decode() if isinstance(kind, bytes) else kind
                raise SourceNotReady(
                    f"dead_letter_stream {target!r} on {self.source.safe_url} is a {shown}, "
                    "not a stream: dead letters wait, unacknowledged"
                )
        copied = [(e, v) for e, v in dead if e.fields is not None] if target else []
        pipe = client.pipeline(transaction=True)
        for entry, verdict in copied:
            pipe.xadd(target, self._dead_letter(entry, verdict))
        pipe.xack(self.stream, self.group, *(entry.id for entry in entries))
        try:
            pipe.execute()
        finally:
            pipe.reset()
        for entry, verdict in copied:
            self._copied_without(entry, verdict)
        self.dead_lettered([verdict for _, verdict in dead])
        self.settled += len(entries)
        return True

    def _dead_letter(self, entry: Entry, verdict: batch.Verdict) -> dict[bytes, bytes]:
        """The entry's fields as read, and ours of the names it has no field of."""
        assert entry.fields is not None
        ours = {
            DEAD_LETTER_REASON: (verdict.reason or "unknown").encode(),
            DEAD_LETTER_ID: entry.id,
            DEAD_LETTER_STREAM: self.stream.encode(),
        }
        # Redis keeps a repeated field name, but redis-py (ours, and most
        # readers') reads it as its last value: ours beside an entry's own
        # (one redriven from a dead-letter stream) would hide it.
        return {**entry.fields, **{k: v for k, v in ours.items() if k not in entry.fields}}

    def _copied_without(self, entry: Entry, verdict: batch.Verdict) -> None:
        """Log (WARNING) the fields of ours a published copy went without: the entry's own."""
        assert entry.fields is not None
        kept = [n.decode() for n in _DEAD_LETTER_FIELDS if n in entry.fields]
        if kept:
            self.copy_kept_own(
                verdict,
                kept,
                "field",
                "the entry has its own, kept",
                f" of entry {entry.id.decode('ascii')}",
            )

    def _hold(self, client: Any, seconds: float) -> None:
        """Wait ``seconds``, the held entries unacknowledged and kept from being claimed."""
        ids = [entry.id for held in self._held for entry in held]
        deadline = time.monotonic() + seconds
        while not self.stop.is_set():
            self._touch(client, ids)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.stop.wait(min(self._touch_every, left))

    @property
    def _touch_every(self) -> float:
        return max(0.1, self.source.claim_idle_seconds / 3)

    def _touch(self, client: Any, ids: list[bytes]) -> None:
        """Reset these pending entries' idle time (their delivery count unchanged)."""
        if ids:
            client.xclaim(self.stream, self.group, self.name, 0, ids, justid=True)

    # -- an entry as the inbox sees it -----------------------------------------------

    def _broker_message(self, entry: Entry) -> BrokerMessage:
        entry_id = entry.id.decode("ascii")
        if entry.fields is None:
            raise Unidentified(PAYLOAD_INVALID, f"entry {entry_id} was deleted from the stream")
        limit = self.source.max_deliveries
        if entry.deliveries > limit:
            raise Unidentified(
                MAX_DELIVERIES,
                f"entry {entry_id} delivered {entry.deliveries} times (max_deliveries {limit})",
            )
        fields = {
            exact_text(name, "a field name"): _text_or_bytes(value)
            for name, value in entry.fields.items()
        }
        body_field = self.source.body_field
        content_type = fields.get("content_type")
        if body_field is None:
            # The whole entry is the body, as JSON (binary values kept exactly).
            body = orjson.dumps(
                {k: binary_text(v) if isinstance(v, bytes) else v for k, v in fields.items()}
            )
            content_type = "application/json"
        else:
            if body_field not in fields:
                raise Unidentified(PAYLOAD_INVALID, f"the entry has no field {body_field!r}")
            body = entry.fields[body_field.encode()]
            del fields[body_field]
        return BrokerMessage(
            body=body,
            content_type=content_type if isinstance(content_type, str) else None,
            headers=fields,
            properties={"id": entry_id},
            meta={"broker": "redis", "stream": self.stream, "group": self.group, "id": entry_id},
        )


def _text_or_bytes(value: bytes) -> str | bytes:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value  # kept exactly; never read as a key or type
