"""The configurable HMAC scheme of generic and cloudevents sources, option by option."""

from __future__ import annotations

import base64
import json

import pytest

from webhook_receiver.config import ConfigError, parse
from webhook_receiver.webhooks.providers import (
    PROVIDERS,
    CloudEventsProvider,
    GenericProvider,
    SignatureError,
    TimestampError,
)
from webhook_receiver.webhooks.providers._scheme import signed_at

from ...helpers.signing import NOW, hmac_digest, inbound, source

P = GenericProvider()
SECRET = "scheme-secret"
BODY = json.dumps({"id": "evt_1", "type": "thing.happened"})


def mac(message: bytes, *, secret: bytes = SECRET.encode(), algorithm: str = "sha256") -> bytes:
    return hmac_digest(message, secret, algorithm)


def src(*secrets: str, **extra):
    return source("generic", *(secrets or (SECRET,)), signature_header="X-Signature", extra=extra)


def sent(signature: str, body: str = BODY, now: float = NOW, **headers: str):
    return inbound(body, {"X-Signature": signature, **headers}, now=now)


@pytest.mark.parametrize("algorithm", ["sha1", "sha256", "sha512"])
@pytest.mark.parametrize("encoding", ["hex", "base64"])
def test_every_algorithm_and_encoding(algorithm: str, encoding: str) -> None:
    digest = mac(BODY.encode(), algorithm=algorithm)
    value = digest.hex() if encoding == "hex" else base64.b64encode(digest).decode()
    P.verify(sent(value), src(algorithm=algorithm, encoding=encoding))


@pytest.mark.parametrize(
    ("signed_with", "configured"), [("sha1", "sha256"), ("sha256", "sha512"), ("sha512", "sha1")]
)
def test_wrong_algorithm_is_refused(signed_with: str, configured: str) -> None:
    value = mac(BODY.encode(), algorithm=signed_with).hex()
    with pytest.raises(SignatureError, match="signature does not match"):
        P.verify(sent(value), src(algorithm=configured))


def test_wrong_encoding_is_refused() -> None:
    digest = mac(BODY.encode())
    with pytest.raises(SignatureError):
        P.verify(sent(base64.b64encode(digest).decode()), src(encoding="hex"))
    with pytest.raises(SignatureError):
        P.verify(sent(digest.hex()), src(encoding="base64"))


@pytest.mark.parametrize("value_prefix", ["v0=", ""])
def test_signature_prefix_is_stripped_when_present(value_prefix: str) -> None:
    P.verify(sent(value_prefix + mac(BODY.encode()).hex()), src(signature_prefix="v0="))


def test_configured_prefix_replaces_the_default_word_prefix() -> None:
    # With a prefix configured, another one is not skipped over.
    with pytest.raises(SignatureError):
        P.verify(sent("sha256=" + mac(BODY.encode()).hex()), src(signature_prefix="v0="))


def test_base64_digest_with_prefix() -> None:
    value = "sha256=" + base64.b64encode(mac(BODY.encode())).decode()
    P.verify(sent(value), src(encoding="base64", signature_prefix="sha256="))


def test_default_is_the_original_generic_scheme() -> None:
    P.verify(sent("sha256=" + mac(BODY.encode()).hex()), src())


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{body}", BODY),
        ("{timestamp}.{body}", f"{NOW}.{BODY}"),
        ("{timestamp}:{body}", f"{NOW}:{BODY}"),
        ("v0:{timestamp}:{body}", f"v0:{NOW}:{BODY}"),
        ("{id}.{timestamp}.{body}", f"msg_1.{NOW}.{BODY}"),
        ("{id}{timestamp}{body}", f"msg_1{NOW}{BODY}"),
    ],
)
def test_signed_content_templates(template: str, message: str) -> None:
    extra: dict[str, str] = {"signed_content": template}
    if "{timestamp}" in template:
        extra["timestamp_header"] = "X-Timestamp"
    if "{id}" in template:
        extra["id_header"] = "X-Webhook-Id"
    d = sent(mac(message.encode()).hex(), **{"X-Timestamp": str(NOW), "X-Webhook-Id": "msg_1"})
    P.verify(d, src(**extra))
    # The same signature over the body alone is not this scheme.
    if template != "{body}":
        headers = {k: v for k, v in d.headers.items() if k != "X-Signature"}
        with pytest.raises(SignatureError):
            P.verify(sent(mac(BODY.encode()).hex(), **headers), src(**extra))


TIMED = {"signed_content": "{timestamp}.{body}", "timestamp_header": "X-Timestamp"}


def timed(stamp: str, now: float = NOW):
    return sent(mac(f"{stamp}.{BODY}".encode()).hex(), now=now, **{"X-Timestamp": stamp})


@pytest.mark.parametrize("offset", [-301, 301])
def test_stale_and_future_timestamps_are_refused(offset: int) -> None:
    with pytest.raises(TimestampError):
        P.verify(timed(str(NOW + offset)), src(**TIMED))


@pytest.mark.parametrize("offset", [-300, 300])
def test_timestamps_at_the_tolerance_pass(offset: int) -> None:
    P.verify(timed(str(NOW + offset)), src(**TIMED))


def test_tolerance_is_the_sources() -> None:
    d = timed(str(NOW - 100))
    with pytest.raises(TimestampError):
        P.verify(
            d,
            source(
                "generic", SECRET, signature_header="X-Signature", extra=TIMED, tolerance_seconds=60
            ),
        )


def test_a_forged_timestamp_fails_the_signature_first() -> None:
    d = timed(str(NOW))
    headers = {**dict(d.headers), "X-Timestamp": str(NOW - 10_000)}
    with pytest.raises(SignatureError, match="signature does not match"):
        P.verify(inbound(BODY, headers), src(**TIMED))


@pytest.mark.parametrize(
    "stamp",
    ["2023-11-14T22:13:20Z", "2023-11-14T22:13:20.634234626Z", "2023-11-14T23:13:20+01:00"],
)
def test_rfc3339_timestamps(stamp: str) -> None:
    assert signed_at(stamp, "X-Timestamp") == NOW
    P.verify(timed(stamp), src(**TIMED))


@pytest.mark.parametrize(
    "stamp",
    [
        "",
        "-5",
        "1e9",
        "9" * 5000,
        "2023-11-14",
        "2023-13-14T22:13:20Z",
        "0000-01-01T00:00:00Z",
        "2023-11-14T22:13:20+24:00",
        "２０２３-11-14T22:13:20Z",
    ],
)
def test_malformed_timestamps_are_refused(stamp: str) -> None:
    with pytest.raises(SignatureError) as info:
        P.verify(timed(stamp), src(**TIMED))
    assert not isinstance(info.value, TimestampError)


def test_missing_timestamp_or_id_header() -> None:
    with pytest.raises(SignatureError, match="missing X-Timestamp header"):
        P.verify(sent(mac(BODY.encode()).hex()), src(**TIMED))
    with pytest.raises(SignatureError, match="missing X-Webhook-Id header"):
        P.verify(
            sent(mac(BODY.encode()).hex()),
            src(signed_content="{id}.{body}", id_header="X-Webhook-Id"),
        )


def test_secrets_are_utf8_and_base64_secrets_raw_bytes() -> None:
    raw = bytes(range(32))
    written = "base64:" + base64.b64encode(raw).decode()
    P.verify(sent(mac(BODY.encode(), secret=raw).hex()), src(written))
    # The written form is not itself the key.
    with pytest.raises(SignatureError):
        P.verify(sent(mac(BODY.encode(), secret=written.encode()).hex()), src(written))
    P.verify(sent(mac(BODY.encode(), secret="clé".encode()).hex()), src("clé"))


def test_rotation_across_secret_kinds() -> None:
    raw = b"\x00\xffraw"
    both = ("base64:" + base64.b64encode(raw).decode(), "plain")
    for key in (raw, b"plain"):
        P.verify(sent(mac(BODY.encode(), secret=key).hex()), src(*both))


def test_cloudevents_reads_the_same_scheme() -> None:
    d = sent(base64.b64encode(mac(BODY.encode(), algorithm="sha512")).decode())
    CloudEventsProvider().verify(
        d,
        source(
            "cloudevents",
            SECRET,
            signature_header="X-Signature",
            extra={"algorithm": "sha512", "encoding": "base64"},
        ),
    )


# Start-up: what the configuration refuses, naming the file, the table and the key.


def config(**table):
    return {
        "sources": {
            "partner": {
                "provider": "generic",
                "secrets": [SECRET],
                "signature_header": "X-Signature",
                **table,
            }
        }
    }


def test_every_option_is_accepted_together() -> None:
    parsed = parse(
        config(
            algorithm="sha512",
            encoding="base64",
            signature_prefix="v1=",
            signed_content="{id}.{timestamp}.{body}",
            timestamp_header="X-Timestamp",
            id_header="X-Webhook-Id",
            tolerance_seconds=60,
            dedup_key="header:X-Webhook-Id",
        ),
        "partner.toml",
        providers=PROVIDERS,
    )
    assert parsed.sources["partner"].extra["algorithm"] == "sha512"


def test_timestamp_placeholder_without_its_header_is_refused_at_start_up(tmp_path) -> None:
    import subprocess

    from ...servers import BIN, ROOT, app_env

    path = tmp_path / "receiver.toml"
    path.write_text(
        '[sources.partner]\nprovider = "generic"\nsecrets = ["s"]\n'
        'signature_header = "X-Signature"\nsigned_content = "{timestamp}.{body}"\n'
    )
    result = subprocess.run(
        [str(BIN / "flask"), "--app", "wsgi", "routes"],
        cwd=ROOT,
        env=app_env(f"sqlite:///{tmp_path / 'app.sqlite3'}", path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    # One line naming the file, table and key; no traceback.
    assert "Traceback" not in result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert f"{path}: [sources.partner] signed_content uses {{timestamp}}" in last_line
    assert "timestamp_header is not set" in last_line
    assert "/webhooks/<source_name>" not in result.stdout  # it never started


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({"algorithm": "md5"}, "algorithm must be one of sha1, sha256, sha512"),
        ({"encoding": "base32"}, "encoding must be one of hex, base64"),
        ({"signature_prefix": ""}, "signature_prefix must be a non-empty string"),
        ({"signed_content": "{timestamp}"}, r"\{body\} must appear exactly once"),
        ({"signed_content": "{body}{body}"}, r"\{body\} must appear exactly once"),
        ({"signed_content": "{nonce}.{body}"}, r"unknown placeholder\(s\) \{nonce\}"),
        ({"signed_content": "{{body}}"}, "a brace outside"),
        ({"signed_content": 5}, "signed_content must be a string"),
        ({"signed_content": "{id}.{body}"}, r"uses \{id\} but id_header is not set"),
        ({"timestamp_header": "X-Timestamp"}, r"does not use \{timestamp\}"),
        ({"id_header": "X-Id"}, r"does not use \{id\}"),
        ({"secrets": ["base64:not base64!"]}, "must be non-empty base64"),
        ({"secrets": ["base64:"]}, "must be non-empty base64"),
        # A blank header name was taken, and every delivery then refused (401).
        ({"signature_header": ""}, "needs signature_header"),
        ({"signature_header": "  "}, "needs signature_header"),
    ],
)
def test_bad_scheme_options_are_refused(table, expected) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        parse(config(**table), "partner.toml", providers=PROVIDERS)
    assert str(info.value).startswith("partner.toml: [sources.partner]")


def test_scheme_options_are_not_for_other_providers() -> None:
    raw = {"sources": {"s": {"provider": "stripe", "secrets": ["whsec_x"], "algorithm": "sha1"}}}
    with pytest.raises(ConfigError, match="unknown key"):
        parse(raw, providers=PROVIDERS)


def test_header_values_are_signed_as_the_bytes_sent() -> None:
    # A server hands header bytes over decoded as Latin-1 (PEP 3333).
    sent_id = "msg-\u00e9"
    message = sent_id.encode("latin-1") + BODY.encode()
    d = sent(mac(message).hex(), **{"X-Webhook-Id": sent_id})
    P.verify(d, src(signed_content="{id}{body}", id_header="X-Webhook-Id"))


def test_a_header_no_server_could_send_is_refused_not_an_error() -> None:
    d = sent(mac(BODY.encode()).hex(), **{"X-Webhook-Id": "msg-\u20ac"})
    with pytest.raises(SignatureError, match="malformed X-Webhook-Id header"):
        P.verify(d, src(signed_content="{id}{body}", id_header="X-Webhook-Id"))
