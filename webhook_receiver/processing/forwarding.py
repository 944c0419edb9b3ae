"""HTTP forwarding: one attempt of sending a stored event to a downstream URL.

The body and content type are the event's own. ``Idempotency-Key`` is
the stable key ``<consumer>:<source>:<dedup key>`` (stable_keys.py): the
same on every attempt and after a requeue, so the downstream can apply each
event once however often it gets it. ``X-Request-Id`` carries the event's
correlation id (and ``traceparent`` its trace id, when the id is one).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote, urlsplit

import requests
from opentelemetry.trace import SpanKind
from standardwebhooks.webhooks import Webhook

from .. import tracing
from ..config import ForwardConfig
from . import attempts, deadline, publishers
from .backoff import is_retryable_status
from .stable_keys import HEADER_SAFE, idempotency_key

log = logging.getLogger(__name__)

USER_AGENT = "webhook-receiver/0.1"
# Read at most this much of an answer: enough for an error message, and
# reading it lets the connection be reused.
MAX_BODY_READ = 64 * 1024


@dataclass(frozen=True)
class Outgoing:
    """What a forward sends for one event."""

    event_id: int
    source: str
    dedup_key: str
    event_type: str | None
    content_type: str | None
    body: bytes
    correlation_id: str | None
    # The traceparent the event was received under (tracing.META_KEY).
    traceparent: str | None = None
    # The tracestate kept beside it (tracing.TRACESTATE_META), sent on with it.
    tracestate: str | None = None
    # Which replay's key the delivery sends: 0 the original (see idempotency_key).
    key_replay: int = 0


@dataclass(frozen=True)
class Result:
    """How one HTTP attempt went."""

    ok: bool
    retryable: bool
    status: int | None = None
    retry_after: str | None = None
    error: str | None = None
    # For the attempt log: the answer's first 2 KB (credentials redacted), or
    # what the broker confirmed.
    response_body: str | None = None
    confirmation: str | None = None


def headers_for(consumer: str, out: Outgoing) -> dict[str, str]:
    """The request headers of a forward."""
    correlation_id = out.correlation_id or f"event-{out.event_id}"
    headers = {
        "Content-Type": _header_value(out.content_type or "application/octet-stream"),
        "Idempotency-Key": idempotency_key(consumer, out.source, out.dedup_key, out.key_replay),
        "X-Request-Id": _header_value(correlation_id),
        "X-Webhook-Source": out.source,
        "X-Webhook-Event-Id": str(out.event_id),
        "User-Agent": USER_AGENT,
    }
    if out.event_type and HEADER_SAFE.match(out.event_type):
        headers["X-Webhook-Event-Type"] = out.event_type
    tracing.outgoing(headers, out.traceparent, correlation_id, out.tracestate)
    return headers


def _header_value(value: str) -> str:
    """``value`` as it is, or percent-encoded when no header can carry it.

    A broker message's correlation id (or content type) is any text: a character past
    Latin-1 (http.client raises UnicodeEncodeError), a line break or a
    leading white space (requests refuses the header) could never be sent.
    """
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        return quote(value, safe="")
    if "\r" in value or "\n" in value or value[:1].isspace():
        return quote(value, safe="")
    return value


def send(http: requests.Session, consumer: str, forward: ForwardConfig, out: Outgoing) -> Result:
    """Send the event once: POST it, or publish it to a broker; never raises for network trouble."""
    with tracing.span(
        "forward",
        kind=SpanKind.CLIENT,
        consumer=consumer,
        event_id=out.event_id,
        dedup_key=out.dedup_key,
        correlation_id=out.correlation_id,
    ) as span:
        if forward.scheme in publishers.BROKER_SCHEMES:
            result = _publish(consumer, forward, out)
        else:
            result = _post(http, consumer, forward, out)
        if span is not None:
            tracing.end_with(span, result.ok, result.status, result.error)
    return result


def _post(http: requests.Session, consumer: str, forward: ForwardConfig, out: Outgoing) -> Result:
    # The timeout bounds the whole attempt, the answer's reading too: a
    # target trickling it out must not hold the worker past its lease.
    deadline.mount(http)
    with deadline.bounded(forward.timeout_seconds) as bound:
        try:
            response = http.post(
                forward.url,
                data=out.body,
                headers=_signed(headers_for(consumer, out), forward, out.body),
                timeout=forward.timeout_seconds,
                # A redirect would turn the POST into a GET; the URL is wrong.
                allow_redirects=False,
                stream=True,
            )
        except requests.RequestException as exc:
            if bound.unresolved is not None:
                error = (
                    f"timeout: {bound.unresolved} did not resolve within "
                    f"{forward.timeout_seconds:g} s"
                )
            elif isinstance(exc, requests.Timeout):
                error = f"timeout: {exc}"
            elif bound.expired:
                error = f"timeout: no whole answer within {forward.timeout_seconds:g} s"
            else:
                error = f"{type(exc).__name__}: {exc}"
            return Result(ok=False, retryable=True, error=_stored_error(error, forward))
        if bound.expired:
            # Cut in its headers, which http.client takes for their end.
            response.close()
            error = f"timeout: no whole answer within {forward.timeout_seconds:g} s"
            return Result(ok=False, retryable=True, error=_stored_error(error, forward))
        with response:
            status = response.status_code
            snippet = _read_some(response)
            retry_after = response.headers.get("Retry-After")
    kept = attempts.response_text(snippet, forward)
    if 200 <= status < 300:
        return Result(ok=True, retryable=False, status=status, response_body=kept)
    # Redacted before it is cut, as the kept body is (a secret cut in two
    # is still found).
    text = _stored_error(snippet.decode("utf-8", "replace").strip(), forward)
    error = f"HTTP {status}" + (f": {text[:500]}" if text else "")
    return Result(
        ok=False,
        retryable=is_retryable_status(status),
        status=status,
        retry_after=retry_after,
        error=error,
        response_body=kept,
    )


def _publish(consumer: str, forward: ForwardConfig, out: Outgoing) -> Result:
    correlation_id = out.correlation_id or f"event-{out.event_id}"
    headers = {"X-Webhook-Source": out.source, "X-Webhook-Event-Id": str(out.event_id)}
    tracing.outgoing(headers, out.traceparent, correlation_id, out.tracestate)
    message = publishers.BrokerMessage(
        body=out.body,
        content_type=out.content_type,
        message_id=idempotency_key(consumer, out.source, out.dedup_key, out.key_replay),
        correlation_id=correlation_id,
        event_type=out.event_type,
        headers=headers,
    )
    try:
        publishers.publish(forward, message)
    except publishers.PublishRefused as exc:
        return Result(ok=False, retryable=False, error=_stored_error(str(exc), forward))
    except publishers.PublishError as exc:
        return Result(ok=False, retryable=True, error=_stored_error(str(exc), forward))
    except Exception as exc:  # a publisher's bug: what its client raised, unforeseen
        # A retry with its back-off and its error on the delivery, rather than
        # a worker thread's crash that leaves the delivery leased to its end.
        # Its text redacted as every forward error is (a client may quote the
        # URL); the traceback, which quotes it as it is, at DEBUG only.
        error = _stored_error(f"{type(exc).__name__}: {exc}", forward)
        log.error("forward %s: the publish failed unexpectedly: %s", forward.name, error)
        log.debug("forward %s: the unexpected failure", forward.name, exc_info=True)
        return Result(ok=False, retryable=True, error=error)
    return Result(ok=True, retryable=False, confirmation=f"{forward.scheme}: publish confirmed")


def _signed(headers: dict[str, str], forward: ForwardConfig, body: bytes) -> dict[str, str]:
    """Add the Standard Webhooks headers when the forward has signing secrets.

    ``webhook-id`` is the stable key, so the downstream deduplicates on it;
    the timestamp is this attempt's. With several secrets (rotation) each
    signs, and the signatures are sent space-separated.
    """
    if not forward.signing_secrets:
        return headers
    msg_id = headers["Idempotency-Key"]
    now = datetime.now(UTC).replace(microsecond=0)
    signatures = [_sign(secret, msg_id, now, body) for secret in forward.signing_secrets]
    return {
        **headers,
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": " ".join(signatures),
    }


def _sign(secret: str, msg_id: str, moment: datetime, body: bytes) -> str:
    try:
        payload = body.decode("utf-8")
    except UnicodeDecodeError:
        # The library signs text; a body that is not UTF-8 is signed over its
        # bytes the same way (HMAC-SHA256 of "id.timestamp.body").
        key = base64.b64decode(secret.removeprefix("whsec_"))
        signed = f"{msg_id}.{int(moment.timestamp())}.".encode() + body
        digest = hmac.new(key, signed, hashlib.sha256).digest()
        return "v1," + base64.b64encode(digest).decode()
    return str(Webhook(secret).sign(msg_id, moment, payload))


def _read_some(response: requests.Response) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        for chunk in response.iter_content(8192):
            chunks.append(chunk)
            size += len(chunk)
            if size >= MAX_BODY_READ:
                break
    except requests.RequestException:
        pass  # the status is what counts; the body was only for the error message
    return b"".join(chunks)[:MAX_BODY_READ]


def _stored_error(error: str, forward: ForwardConfig) -> str:
    """An attempt's error as every place keeps it, credentials redacted.

    Made once, here: the delivery's last error (the admin shows it), the
    attempt log, the worker's log line and the trace's span all get this
    text. The forward URL's query (where tokens travel) goes whole, then
    what looks like a credential in an answer quoted (attempts.redact, with
    the forward's own secrets).
    """
    parts = urlsplit(forward.url)
    if parts.query:
        error = error.replace("?" + parts.query, "?[redacted]")
        error = error.replace(parts.query, "[redacted]")
    return attempts.redact(error, forward)
