"""Standard Webhooks (and Svix): ``webhook-id``/``-timestamp``/``-signature``; key is the id.

The signature is computed by the ``standardwebhooks`` library's ``Webhook.sign``.
Its ``verify`` is not used because it checks a fixed five-minute window against
its own clock; here the window is ``source.tolerance_seconds`` around
``inbound.now``. The ``svix-*`` header names are accepted as a whole family in
place of the ``webhook-*`` ones. Only ``v1`` (symmetric) signatures are checked.
"""

from __future__ import annotations

import binascii
from datetime import UTC, datetime

from standardwebhooks.webhooks import EmptyWebhookSecretError, Webhook

from . import _common as c
from .base import Identified, Inbound, SignatureError, SourceConfig


def _family(inbound: Inbound) -> str:
    # Never mix names: a delivery is either Standard-Webhooks-branded or Svix-branded.
    return "webhook" if "webhook-signature" in inbound.headers else "svix"


def _expected(secret: str, msg_id: str, signed_at: int, body: str) -> bytes | None:
    try:
        signer = Webhook(secret)
    except (binascii.Error, ValueError, EmptyWebhookSecretError):
        return None  # not a whsec_<base64> secret: it cannot match anything
    # sign() returns "v1,<base64>"; compare raw digests, not base64 spellings.
    try:
        when = datetime.fromtimestamp(signed_at, UTC)
    except (OverflowError, OSError, ValueError):
        return None  # a timestamp no clock can hold: nothing signed it
    signed = signer.sign(msg_id=msg_id, timestamp=when, data=body)
    return c.from_b64(signed.partition(",")[2])


class StandardProvider:
    """Senders following the Standard Webhooks spec, Svix among them."""

    name: str = "standard"
    requires_json: bool = True
    secret_headers: frozenset[str] = frozenset(
        {"webhook-signature", "svix-signature", "webhook-timestamp", "svix-timestamp"}
    )

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """Check any v1 signature against every secret, then the timestamp."""
        family = _family(inbound)
        # The id is the dedup key: sent twice, it is a malformed delivery
        # (400), not a forged one.
        c.key_header(inbound, f"{family}-id")
        msg_id = c.header(inbound, f"{family}-id")
        signed_at = c.timestamp(c.header(inbound, f"{family}-timestamp"), f"{family}-timestamp")
        signatures = []
        for item in c.header(inbound, f"{family}-signature").split():
            version, sep, data = item.partition(",")
            if not sep:
                raise SignatureError(f"malformed {family}-signature header")
            digest = c.from_b64(data) if version == "v1" else None
            if digest is not None:
                signatures.append(digest)
        if not signatures:
            raise SignatureError(f"no v1 signature in {family}-signature header")
        try:
            body = inbound.body.decode()  # the library signs text
        except UnicodeDecodeError as exc:
            raise SignatureError("body is not UTF-8") from exc
        expected = [_expected(s, msg_id, signed_at, body) for s in c.secrets_of(source)]
        if not c.any_match((e for e in expected if e is not None), signatures):
            raise SignatureError("signature does not match")
        c.check_tolerance(signed_at, inbound, source)

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """The message id is the same on every attempt; the type is the payload's ``type``."""
        payload = c.json_object(inbound)
        header = f"{_family(inbound)}-id"
        return Identified(
            dedup_key=c.dedup_key(c.key_header(inbound, header), header),
            event_type=c.str_or_none(payload.get("type")),
        )
