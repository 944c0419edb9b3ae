"""The Amazon SQS consumer: boto3's receive_message, then delete_message_batch after the commit.

A batch is up to ``batch`` messages, received 10 at a time (SQS's most per
receive): a long poll for the first, then as many more as the queue hands
over at once. The inbox stores it in one transaction, and only then is
each message settled (:mod:`.pulled`: receiving, storing and settling
overlap, a thread each): deleted (``DeleteMessageBatch``) when new or a
duplicate; a conflict or a message that cannot be stored is sent to
``dead_letter_queue_url`` (body and attributes unchanged, plus a
``dead-letter-reason`` attribute) and deleted, or, without one, left to
the queue's redrive policy (``maxReceiveCount``) and logged. Every
message in hand has its visibility extended past half the queue's timeout
(:mod:`.leases`), so a slow store never lets it reappear. The database
away: the batch's visibility is set to the back-off, nothing is deleted,
and the consumer waits. Credentials come from the standard AWS chain; a
connection error reconnects with back-off, and what was not deleted comes
back and is recognised as duplicates.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from ..config import BrokerSourceConfig
from . import batch
from .identify import BrokerMessage
from .leases import Leases
from .outage import SourceNotReady
from .pulled import PulledConsumer

log = logging.getLogger(__name__)

# How long the first receive of a batch waits for a message (a long poll);
# the stop flag is looked at between polls.
RECEIVE_WAIT_SECONDS = 1
# SQS's most per receive, per delete, per send and per visibility change.
PER_CALL = 10
# The attribute a dead letter carries its reason in (and SQS's most per message).
DEAD_LETTER_REASON = "dead-letter-reason"
MAX_ATTRIBUTES = 10
# The most a SendMessageBatch's messages may hold together (SQS refuses the
# whole call past it: 256 KiB on queues of old, 1 MiB since 2025).
SEND_BATCH_BYTES = 256 * 1024
# How long a message whose dead-letter copy could not be sent stays hidden
# before it comes back (to be dead-lettered again).
DEAD_LETTER_RETRY_SECONDS = 5
# Set by SQS on each receive: kept out of the stored meta.
_PER_RECEIVE = frozenset({"ApproximateReceiveCount", "ApproximateFirstReceiveTimestamp"})
_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError)
_NO_QUEUE = frozenset(
    {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist", "NonExistentQueue"}
)
# What SQS answers for a message refused for what it holds (too long, most
# often), the call's or one entry's: permanent, never retried as it was.
_REFUSED = frozenset(
    {
        "InvalidParameterValue",
        "InvalidMessageContents",
        "AWS.SimpleQueueService.BatchRequestTooLong",
        "BatchRequestTooLong",
    }
)
# One message as boto3 hands it over (a dict: MessageId, ReceiptHandle, Body, ...).
Raw = dict[str, Any]
# A copy refused for what it holds: the message, its verdict, SQS's words.
_Refused = tuple[Raw, batch.Verdict, str]


class SqsConsumer(PulledConsumer):
    """Consume one SQS queue (standard or FIFO) into the inbox until ``stop`` is set."""

    broker_errors = _ERRORS
    logger = log
    reason_field = f"{DEAD_LETTER_REASON} attribute"
    settled_without_copy = "the message is deleted"

    # The session's boto3 client (thread-safe: the three stages share it).
    _sqs: Any = None

    def _client(self) -> Any:
        return boto3.session.Session().client(
            "sqs",
            region_name=self.source.region,
            endpoint_url=self.source.endpoint_url,
            # Our own back-off decides; a long poll must not be cut short.
            config=botocore.config.Config(
                retries={"max_attempts": 2, "mode": "standard"},
                connect_timeout=5,
                read_timeout=RECEIVE_WAIT_SECONDS + 10,
                max_pool_connections=4,
            ),
        )

    def session(self) -> None:
        client = self._client()
        attributes = self._queue_attributes(client)
        visibility = int(attributes.get("VisibilityTimeout", 30))
        if not self.source.dead_letter_queue_url and "RedrivePolicy" not in attributes:
            log.warning(
                "source %s: queue %r has no redrive policy and the source no "
                "dead_letter_queue_url: conflicts and poison messages come back after each "
                "visibility timeout, for ever",
                self.source.name,
                self.source.queue,
                extra={"source": self.source.name},
            )
        log.info(
            "source %s: consuming queue %r on %s",
            self.source.name,
            self.source.queue,
            self.source.endpoint_url or self.source.region,
        )
        self.not_ready.recovered()
        self.broker.recovered()
        self._sqs = client
        leases = Leases(self.source.name, visibility, self.give_back, "visibility timeout")
        try:
            self.pipeline(leases)
        finally:
            leases.close()

    def _queue_attributes(self, client: Any) -> dict[str, str]:
        try:
            response = client.get_queue_attributes(
                QueueUrl=self.source.url, AttributeNames=["VisibilityTimeout", "RedrivePolicy"]
            )
        except botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _NO_QUEUE:
                raise SourceNotReady(
                    f"queue {self.source.url} does not exist; "
                    f"create it (flask --app wsgi brokers declare {self.source.name})"
                ) from exc
            raise
        return dict(response.get("Attributes") or {})

    def receive(self) -> list[Raw]:
        """Up to ``batch`` messages: one long poll, then what the queue hands over at once."""
        raws: list[Raw] = []
        wait = RECEIVE_WAIT_SECONDS
        while len(raws) < self.source.batch:
            want = min(PER_CALL, self.source.batch - len(raws))
            got = self._sqs.receive_message(
                QueueUrl=self.source.url,
                MaxNumberOfMessages=want,
                WaitTimeSeconds=wait,
                MessageAttributeNames=["All"],
                MessageSystemAttributeNames=["All"],
            ).get("Messages", [])
            raws += got
            if len(got) < want or self.stop.is_set():
                break
            wait = 0
        return raws

    def give_back(self, raws: Sequence[Raw], seconds: int) -> None:
        """Hide ``raws`` for ``seconds`` more (their visibility timeout from now)."""
        _change_visibility(self._sqs, self.source.url, raws, seconds)

    def reader(self) -> Any:
        """The function that turns one of the source's raw messages into a BrokerMessage."""
        return _reader_of(self.source)

    def settle(self, raws: list[Raw], verdicts: list[batch.Verdict]) -> None:
        """Delete the stored messages; dead-letter the others (or leave them to the redrive)."""
        client = self._sqs
        done: list[Raw] = []
        dead: list[tuple[Raw, batch.Verdict]] = []
        left: list[batch.Verdict] = []
        for raw, verdict in zip(raws, verdicts, strict=True):
            if verdict.action == batch.ACK:
                done.append(raw)
            elif self.source.dead_letter_queue_url:
                dead.append((raw, verdict))
            else:
                left.append(verdict)
        sent, failed = self._dead_letter(client, dead)
        try:
            _delete(client, self.source, done + [raw for raw, _ in sent])
        finally:
            # Those sent before a lost connection are dead-lettered all the same.
            self.dead_lettered([verdict for _, verdict in sent])
        if failed:
            self.give_back(failed, DEAD_LETTER_RETRY_SECONDS)
        for verdict in left:
            log.warning(
                "source %s: message not stored (%s: %s); left to the queue's redrive policy",
                self.source.name,
                verdict.reason,
                verdict.detail,
                extra={"source": self.source.name, "reason": verdict.reason},
            )
        self.settled += len(raws) - len(failed) - len(left)

    def _dead_letter(
        self, client: Any, dead: list[tuple[Raw, batch.Verdict]]
    ) -> tuple[list[tuple[Raw, batch.Verdict]], list[Raw]]:
        """Send copies to the dead-letter queue; (those settled, the messages whose copy failed).

        A copy refused for what it holds (too long: the reason attribute
        counts towards SQS's size) is sent again without the reason; one
        refused still is never sent, and its message is settled without one.
        """
        url = self.source.dead_letter_queue_url or ""
        sent: list[tuple[Raw, batch.Verdict]] = []
        failed: list[Raw] = []
        refused: list[_Refused] = []
        for chunk in _send_batches(dead):
            self._send(client, url, chunk, True, sent, failed, refused)
        for raw, verdict in sent:
            why_not = _no_room(raw.get("MessageAttributes") or {})
            if why_not is not None:
                self.copy_without_reason(verdict, why_not, f" of message {raw['MessageId']}")
        again, refused = refused, []
        for raw, verdict, why in again:
            self._send(client, url, [(raw, verdict)], False, sent, failed, refused)
            if sent and sent[-1][0] is raw:
                self.copy_without_reason(
                    verdict, why, f" of message {raw['MessageId']}", refused=True
                )
        for raw, verdict, why in refused:
            # No copy can ever be sent: deleted without one, rather than
            # received and refused again every few seconds, for ever.
            self.copy_refused(verdict, why, f" of message {raw['MessageId']}")
            sent.append((raw, verdict))
        return sent, failed

    def _send(
        self,
        client: Any,
        url: str,
        chunk: list[tuple[Raw, batch.Verdict]],
        with_reason: bool,
        sent: list[tuple[Raw, batch.Verdict]],
        failed: list[Raw],
        refused: list[_Refused],
    ) -> None:
        """Send ``chunk``'s copies in one call; each to ``sent``, ``failed`` or ``refused``."""
        entries = [
            _copy(str(n), raw, verdict, url, with_reason=with_reason)
            for n, (raw, verdict) in enumerate(chunk)
        ]
        try:
            response = client.send_message_batch(QueueUrl=url, Entries=entries)
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error", {})
            if error.get("Code") not in _REFUSED:
                self._not_sent(url, exc, chunk, failed)
            elif len(chunk) > 1:
                # SQS refuses the whole call for one entry: each is sent alone to find it.
                for item in chunk:
                    self._send(client, url, [item], with_reason, sent, failed, refused)
            else:
                refused.append((*chunk[0], error.get("Message") or error.get("Code") or ""))
            return
        except _ERRORS as exc:
            self._not_sent(url, exc, chunk, failed)
            return
        failures = {entry["Id"]: entry for entry in response.get("Failed", [])}
        for n, (raw, verdict) in enumerate(chunk):
            entry = failures.get(str(n))
            why = entry and (entry.get("Message") or entry.get("Code"))
            if entry is None:
                sent.append((raw, verdict))
            elif entry.get("SenderFault") and entry.get("Code") in _REFUSED:
                refused.append((raw, verdict, why or ""))
            else:
                log.error(
                    "source %s: the dead-letter queue refused a copy (%s); the message is retried",
                    self.source.name,
                    why,
                    extra={"source": self.source.name},
                )
                failed.append(raw)

    def _not_sent(
        self,
        url: str,
        exc: BaseException,
        chunk: list[tuple[Raw, batch.Verdict]],
        failed: list[Raw],
    ) -> None:
        log.error(
            "source %s: could not dead-letter to %s (%s); the messages are retried",
            self.source.name,
            url,
            exc,
            extra={"source": self.source.name},
        )
        failed += [raw for raw, _ in chunk]


def _send_batches(
    dead: list[tuple[Raw, batch.Verdict]],
) -> list[list[tuple[Raw, batch.Verdict]]]:
    """``dead`` cut into SendMessageBatch calls: 10 at most, within SEND_BATCH_BYTES together.

    SQS refuses a whole call whose messages hold more; one larger message goes alone.
    """
    chunks: list[list[tuple[Raw, batch.Verdict]]] = []
    size = 0
    for raw, verdict in dead:
        length = _size(raw)
        if not chunks or len(chunks[-1]) == PER_CALL or size + length > SEND_BATCH_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append((raw, verdict))
        size += length
    return chunks


def _size(raw: Raw) -> int:
    """A copy's size as SQS counts it: the body, each attribute's name, type and value."""
    size = len(raw["Body"].encode("utf-8")) + len(DEAD_LETTER_REASON) + 64
    for name, value in (raw.get("MessageAttributes") or {}).items():
        data = value.get("StringValue")
        data = data.encode("utf-8") if data is not None else value.get("BinaryValue", b"")
        size += len(name.encode("utf-8")) + len(value.get("DataType", "")) + len(data)
    return size


def _copy(
    entry_id: str, raw: Raw, verdict: batch.Verdict, url: str, *, with_reason: bool = True
) -> dict[str, Any]:
    """A dead letter: the body and attributes as received, the reason beside them (if it fits)."""
    attributes = dict(raw.get("MessageAttributes") or {})
    if with_reason and _no_room(attributes) is None:
        attributes[DEAD_LETTER_REASON] = {
            "DataType": "String",
            "StringValue": verdict.reason or "unknown",
        }
    entry: dict[str, Any] = {"Id": entry_id, "MessageBody": raw["Body"]}
    if attributes:
        entry["MessageAttributes"] = attributes
    if url.endswith(".fifo"):
        system = raw.get("Attributes") or {}
        entry["MessageGroupId"] = system.get("MessageGroupId") or "dead-letters"
        # A copy sent again after a crash is dropped by the queue's dedup window.
        entry["MessageDeduplicationId"] = f"dead-letter-{raw['MessageId']}"
    return entry


def _no_room(attributes: Mapping[str, Any]) -> str | None:
    """Why a copy cannot carry the reason attribute, or None when it can."""
    if DEAD_LETTER_REASON in attributes:
        return "the message has one of its own, kept"
    if len(attributes) >= MAX_ATTRIBUTES:
        return f"the message has SQS's most of {MAX_ATTRIBUTES} attributes"
    return None


def _delete(client: Any, source: BrokerSourceConfig, raws: Sequence[Raw]) -> None:
    for start in range(0, len(raws), PER_CALL):
        chunk = raws[start : start + PER_CALL]
        response = client.delete_message_batch(
            QueueUrl=source.url,
            Entries=[
                {"Id": str(n), "ReceiptHandle": r["ReceiptHandle"]} for n, r in enumerate(chunk)
            ],
        )
        for entry in response.get("Failed", []):
            # Its receipt handle expired: it comes back and is a duplicate then.
            log.warning(
                "source %s: a stored message could not be deleted (%s); it will come back "
                "and be recognised as a duplicate",
                source.name,
                entry.get("Message") or entry.get("Code"),
                extra={"source": source.name},
            )


def _change_visibility(client: Any, url: str, raws: Sequence[Raw], seconds: int) -> None:
    for start in range(0, len(raws), PER_CALL):
        chunk = raws[start : start + PER_CALL]
        client.change_message_visibility_batch(
            QueueUrl=url,
            Entries=[
                {"Id": str(n), "ReceiptHandle": r["ReceiptHandle"], "VisibilityTimeout": seconds}
                for n, r in enumerate(chunk)
            ],
        )


def _reader_of(source: BrokerSourceConfig) -> Any:
    """The function that turns one of ``source``'s raw messages into a BrokerMessage."""

    def read(raw: Raw) -> BrokerMessage:
        headers = {
            name: _attribute(value) for name, value in (raw.get("MessageAttributes") or {}).items()
        }
        system = raw.get("Attributes") or {}
        properties = {"message_id": raw["MessageId"]}
        if "MessageDeduplicationId" in system:
            properties["deduplication_id"] = system["MessageDeduplicationId"]
        content_type = next(
            (v for k, v in headers.items() if k.lower() == "content-type" and type(v) is str), None
        )
        return BrokerMessage(
            body=raw["Body"].encode("utf-8"),
            content_type=content_type,
            headers=headers,
            properties=properties,
            meta={
                "broker": "sqs",
                "queue_url": source.url,
                "message_id": raw["MessageId"],
                "attributes": {k: v for k, v in system.items() if k not in _PER_RECEIVE},
            },
        )

    return read


def _attribute(value: dict[str, Any]) -> str | bytes:
    """A message attribute's value as text; bytes where a Binary one is not UTF-8 (kept exactly)."""
    if "StringValue" in value:
        return str(value["StringValue"])
    binary = value.get("BinaryValue", b"")
    try:
        return bytes(binary).decode("utf-8")
    except UnicodeDecodeError:
        return bytes(binary)
