"""Bad input through a real gunicorn: a clear 4xx, nothing stored, the server still serving.

Requests are written to a raw socket, so that what an HTTP client library
would refuse to send (a bare LF in a header, a header twice, invalid UTF-8,
a body over the limit, chunked or not) reaches the server as it is. Malformed
header lines never reach the app: gunicorn's parser answers them with its
own 400 page, so those cases check the status only.

After each case the tables are exactly as before (but for the one valid
delivery among them, a lone surrogate's escape in a Stripe event's data,
which is stored), with one exception by design: a webhook delivery refused
before storage leaves a count in ``rejections`` (no body) under its reason:
``signature`` when it is not authentic, ``refused-<problem>`` when it is
signed but refused for what it holds (its sender will retry it unchanged).
A refusal gunicorn answers itself, or one the app refuses before the
signature is checked (413), leaves none. An API request refused before its
view began (a body that does not parse or validate, 413, 415) binds no
Idempotency-Key: nothing is saved, and the corrected request with the same
key is answered afresh.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests
from sqlalchemy import create_engine, text

from .conftest import ACME_TOKEN
from .helpers import signing as s
from .servers import Server, gunicorn

LIMIT = 64 * 1024
CONFIG = f"""
[sources.stripe-live]
provider = "stripe"
secrets = ["{s.STRIPE_SECRET}"]
# The cases are signed when collected: a long suite must not make them stale.
tolerance_seconds = 86400

[sources.github]
provider = "github"
secrets = ["{s.GITHUB_SECRET}"]

[clients.acme]
token = "{ACME_TOKEN}"
"""
TABLES = (
    "events",
    "event_duplicates",
    "event_conflicts",
    "deliveries",
    "idempotency_records",
    "rejections",
)
NOTHING = "nothing"


def rejected(reason: str) -> str:
    """What a refused webhook delivery leaves: one more count in ``rejections`` under ``reason``."""
    return f"rejections:{reason}"


# A delivery the app takes in: one more event.
STORED = "events"
UNAUTHENTIC = rejected("signature")
INVALID = rejected("refused-payload-invalid")
NO_KEY = rejected("refused-dedup-key-missing")
BAD_MEDIA_TYPE = rejected("refused-unsupported-media-type")


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def raw(server: Server, data: bytes) -> Response:
    """Send bytes as they are and read the whole answer."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Response(int(status_line.split()[1]), headers, body)


def request(path: str, headers: list[tuple[bytes, bytes]], body: bytes = b"", *, length=True):
    lines = [f"POST {path} HTTP/1.1".encode(), b"Host: localhost", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    if length:
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def chunked(body: bytes, size: int = 4096) -> bytes:
    parts = [
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    ]
    return b"".join(parts) + b"0\r\n\r\n"


def stripe_signature(body: bytes) -> bytes:
    """A ``Stripe-Signature`` of ``body`` for the test source, now."""
    return s.stripe_signature(body, s.STRIPE_SECRET, int(time.time())).encode()


JSON = (b"Content-Type", b"application/json")


def webhook(body: bytes, *extra: tuple[bytes, bytes], sign_for: bytes | None = None, ct=JSON):
    signature = (b"Stripe-Signature", stripe_signature(body if sign_for is None else sign_for))
    headers = [signature, *([ct] if ct else []), *extra]
    return request("/webhooks/stripe-live", headers, body)


def github_delivery(*ids: bytes) -> bytes:
    """A correctly signed GitHub delivery whose X-GitHub-Delivery line comes once per id."""
    body = b'{"action":"opened","zen":"ok"}'
    digest = s.hmac_hex(body, s.GITHUB_SECRET)
    headers = [(b"X-Hub-Signature-256", f"sha256={digest}".encode()), JSON]
    headers += [(b"X-GitHub-Event", b"issues")] + [(b"X-GitHub-Delivery", i) for i in ids]
    return request("/webhooks/github", headers, body)


def stripe_event(**fields) -> bytes:
    return json.dumps({"id": "evt_bad", "type": "invoice.paid", "data": {}, **fields}).encode()


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b'{"a":' * depth + inner + b"}" * depth


AUTH = (b"Authorization", f"Bearer {ACME_TOKEN}".encode())
LONG_TYPE = (b"Content-Type", b"application/json; x=" + b"y" * 280)
UNKNOWN = [(b"Authorization", b"Bearer not-a-token-at-all"), JSON, (b"Idempotency-Key", b"k-3")]
ORDER = b'{"type":"order.created","data":{"n":1}}'


def api(body: bytes = ORDER, *extra: tuple[bytes, bytes], key: bytes | None = b"k-1", ct=JSON):
    headers = [AUTH, *([ct] if ct else []), *extra]
    if key is not None:
        headers.append((b"Idempotency-Key", key))
    return request("/api/events", headers, body)


def too_big(path: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    # Announced: only the headers are sent; the server must not wait for the body.
    return request(path, [*headers, (b"Content-Length", b"%d" % (100 * LIMIT))], length=False)


def too_big_chunked(path: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    body = b'{"id":"evt_big","data":"' + b"x" * (LIMIT + 1000) + b'"}'
    return request(
        path, [*headers, (b"Transfer-Encoding", b"chunked")], chunked(body), length=False
    )


# (name, request bytes, status, problem slug or None (gunicorn's own page, a 200), what remains)
def webhook_cases() -> list[tuple[object, ...]]:
    """The cases, signed now: a Stripe signature made at import would be stale in a long run."""
    return [
        (
            "invalid UTF-8",
            webhook(b'{"id":"evt_\xff\xfe","type":"t"}'),
            400,
            "payload-invalid",
            INVALID,
        ),
        (
            "over the limit (Content-Length)",
            too_big("/webhooks/stripe-live", [JSON]),
            413,
            "payload-too-large",
            NOTHING,
        ),
        (
            "over the limit (chunked)",
            too_big_chunked("/webhooks/stripe-live", [JSON]),
            413,
            "payload-too-large",
            NOTHING,
        ),
        (
            "nested 257 deep",
            webhook(stripe_event(data=json.loads(nested(257)))),
            400,
            "payload-invalid",
            INVALID,
        ),
        (
            "nested 5000 deep",
            webhook(b'{"id":"e","data":' + nested(5000) + b"}"),
            400,
            "payload-invalid",
            INVALID,
        ),
        (
            # Valid JSON (RFC 8259 8.2), stored as sent: the escape is ASCII.
            "lone surrogate in the data",
            webhook(b'{"id":"evt_s","type":"t","data":"\\ud800"}'),
            200,
            None,
            STORED,
        ),
        (
            "lone surrogate in the dedup key",
            webhook(b'{"id":"evt_\\udc00","type":"t"}'),
            400,
            "payload-invalid",
            INVALID,
        ),
        (
            "NUL in the dedup key",
            webhook(b'{"id":"evt_\\u0000","type":"t"}'),
            400,
            "payload-invalid",
            INVALID,
        ),
        (
            "NUL in the type",
            webhook(b'{"id":"evt_n","type":"a\\u0000b"}'),
            400,
            "payload-invalid",
            INVALID,
        ),
        (
            "dedup key of 513 characters",
            webhook(stripe_event(id="e" * 513)),
            400,
            "dedup-key-missing",
            NO_KEY,
        ),
        (
            "type of 256 characters",
            webhook(stripe_event(type="t" * 256)),
            400,
            "payload-invalid",
            INVALID,
        ),
        (
            "Content-Type of 300 characters",
            webhook(stripe_event(), ct=LONG_TYPE),
            415,
            "unsupported-media-type",
            BAD_MEDIA_TYPE,
        ),
        (
            "missing Content-Type",
            webhook(stripe_event(), ct=None),
            415,
            "unsupported-media-type",
            BAD_MEDIA_TYPE,
        ),
        (
            "a signature for another body",
            webhook(stripe_event(), sign_for=stripe_event(id="evt_other")),
            401,
            "signature-invalid",
            UNAUTHENTIC,
        ),
        (
            "signature header twice",
            webhook(stripe_event(), (b"Stripe-Signature", stripe_signature(stripe_event()))),
            401,
            "signature-invalid",
            UNAUTHENTIC,
        ),
        (
            "bare LF in a header (injection)",
            webhook(stripe_event(), (b"X-Note", b"a\nX-Injected: 1")),
            400,
            None,
            NOTHING,
        ),
        ("bare CR in a header", webhook(stripe_event(), (b"X-Note", b"a\rb")), 400, None, NOTHING),
        (
            "dedup-key header twice (joined with a comma)",
            github_delivery(b"d-1", b"d-2"),
            400,
            "payload-invalid",
            INVALID,
        ),
        ("NUL in a header", webhook(stripe_event(), (b"X-Note", b"a\x00b")), 400, None, NOTHING),
        (
            "folded header line",
            webhook(stripe_event(), (b"X-Note", b"a\r\n b")),
            400,
            None,
            NOTHING,
        ),
    ]


API_CASES = [
    (
        "Idempotency-Key of 256 characters",
        api(key=b"k" * 256),
        400,
        "idempotency-key-invalid",
        NOTHING,
    ),
    (
        "Idempotency-Key with non-ASCII bytes",
        api(key=b"caf\xc3\xa9"),
        400,
        "idempotency-key-invalid",
        NOTHING,
    ),
    ("Idempotency-Key with a control character", api(key=b"a\x01b"), 400, None, NOTHING),
    (
        "Idempotency-Key twice",
        api(ORDER, (b"Idempotency-Key", b"k-1")),
        400,
        "idempotency-key-invalid",
        NOTHING,
    ),
    (
        "Idempotency-Key with bare LF (injection)",
        api(key=b"k-2\nX-Injected: 1"),
        400,
        None,
        NOTHING,
    ),
    ("Idempotency-Key with bare CR", api(key=b"k-2\rX"), 400, None, NOTHING),
    ("Idempotency-Key folded", api(key=b"k-2\r\n more"), 400, None, NOTHING),
    ("Authorization twice", api(ORDER, AUTH), 401, "unauthorized", NOTHING),
    ("an unknown token", request("/api/events", UNKNOWN, ORDER), 401, "unauthorized", NOTHING),
    (
        "over the limit (Content-Length)",
        too_big("/api/events", [AUTH, JSON, (b"Idempotency-Key", b"k-4")]),
        413,
        "payload-too-large",
        NOTHING,
    ),
    (
        "over the limit (chunked)",
        too_big_chunked("/api/events", [AUTH, JSON, (b"Idempotency-Key", b"k-5")]),
        413,
        "payload-too-large",
        NOTHING,
    ),
    (
        "invalid UTF-8",
        api(b'{"type":"t\xff","data":1}', key=b"k-6"),
        400,
        "invalid-json",
        NOTHING,
    ),
    (
        "nested 257 deep",
        api(b'{"type":"t","data":' + nested(257) + b"}", key=b"k-7"),
        400,
        "invalid-json",
        NOTHING,
    ),
    (
        "nested 970 deep",
        api(b'{"type":"t","data":' + nested(970) + b"}", key=b"k-8"),
        400,
        "invalid-json",
        NOTHING,
    ),
    (
        "lone surrogate",
        api(b'{"type":"t","data":"\\udc00"}', key=b"k-9"),
        400,
        "invalid-json",
        NOTHING,
    ),
    (
        "NUL in the type",
        api(b'{"type":"a\\u0000","data":1}', key=b"k-10"),
        400,
        "invalid-event",
        NOTHING,
    ),
    (
        "missing Content-Type",
        api(key=b"k-11", ct=None),
        415,
        "unsupported-media-type",
        NOTHING,
    ),
    (
        "Content-Type of 300 characters",
        api(key=b"k-12", ct=LONG_TYPE),
        415,
        "unsupported-media-type",
        NOTHING,
    ),
]


def snapshot(engine) -> dict[str, int]:
    with engine.connect() as conn:
        counts = {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in TABLES}
        # Refusals are counted per source, reason, address and minute: each
        # reason's count is compared, not just the rows.
        del counts["rejections"]
        by_reason = conn.execute(
            text("SELECT reason, sum(seen_count) FROM rejections GROUP BY reason")
        )
        counts.update({rejected(reason): int(seen) for reason, seen in by_reason})
        return counts


@pytest.fixture
def server(db_url, tmp_path) -> Iterator[Server]:
    # Each refusal written before its answer, so that a snapshot right after sees it.
    env = {
        "WEBHOOK_RECEIVER_MAX_BODY_BYTES": str(LIMIT),
        "WEBHOOK_RECEIVER_REJECTION_FLUSH_SECONDS": "0",
    }
    with gunicorn(db_url, CONFIG, tmp_path, workers=2, env=env) as running:
        yield running


@pytest.fixture
def engine(db_url):
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


def run_cases(server, engine, cases) -> None:
    failures = []
    for name, data, status, slug, remains in cases:
        before = snapshot(engine)
        response = raw(server, data)
        after = snapshot(engine)
        expected = dict(before)
        if remains != NOTHING:
            expected[remains] = expected.get(remains, 0) + 1
        problem = None
        if response.headers.get("content-type") == "application/problem+json":
            problem = json.loads(response.body)["type"].removeprefix("/problems/")
        got = (response.status, problem, after)
        if got != (status, slug, expected):
            failures.append(
                f"{name}: got {got[:2]}, {after}; expected {(status, slug)}, {expected}"
            )
        if requests.get(f"{server.url}/healthz", timeout=5).status_code != 200:
            failures.append(f"{name}: /healthz failed after it")
    assert not failures, "\n".join(failures) + "\n" + server.log()[-3000:]


@pytest.mark.slow
def test_bad_webhook_deliveries(server, engine):
    run_cases(server, engine, webhook_cases())
    # Still receiving: a good delivery after all of that is stored.
    good = raw(server, webhook(stripe_event(id="evt_good")))
    assert good.status == 200, good.body


@pytest.mark.slow
def test_bad_api_requests(server, engine):
    run_cases(server, engine, API_CASES)
    # Refused before the view began: answered afresh, never replayed, nothing kept.
    again = raw(server, api(b'{"type":"a\\u0000","data":1}', key=b"k-10"))
    assert (again.status, again.headers.get("idempotent-replayed")) == (400, None)
    with engine.connect() as conn:
        count = conn.execute(text("SELECT count(*) FROM idempotency_records")).scalar_one()
        assert count == 0
    # The key a refused request named is free for the corrected one.
    assert raw(server, api(key=b"k-10")).status == 201
    assert raw(server, api(key=b"k-good")).status == 201


SQL = "'; DROP TABLE events; --"
HTML = "<script>alert(1)</script>"


@pytest.mark.slow
def test_sql_and_html_like_strings_are_stored_verbatim(server, engine):
    payload = {"id": f"evt_{SQL}", "type": HTML, "data": {"q": "1' OR '1'='1", "h": HTML}}
    body = json.dumps(payload).encode()
    response = raw(server, webhook(body))
    assert response.status == 200, response.body
    event_id = json.loads(response.body)["event_id"]
    order = json.dumps({"type": HTML, "data": {"sql": SQL}}).encode()
    key = b"'; DELETE FROM idempotency_records; --"
    created = raw(server, api(order, key=key))
    assert created.status == 201, created.body
    assert created.headers["content-type"] == "application/json"
    assert json.loads(created.body)["type"] == HTML
    assert raw(server, api(order, key=key)).headers.get("idempotent-replayed") == "true"
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, source, dedup_key, event_type, body FROM events"))
        stored = {row.id: row for row in rows}
        keys = conn.execute(text("SELECT key FROM idempotency_records")).scalars().all()
    assert len(stored) == 2
    hook = stored[event_id]
    assert (hook.dedup_key, hook.event_type, bytes(hook.body)) == (f"evt_{SQL}", HTML, body)
    (api_event,) = [row for row in stored.values() if row.source == "api:acme"]
    assert (api_event.event_type, bytes(api_event.body)) == (HTML, order)
    assert keys == [key.decode()]
    assert requests.get(f"{server.url}/healthz", timeout=5).status_code == 200


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        (nested(256), False),
        (nested(257), True),
        (b"[" * 256 + b"]" * 256, False),
        (b"[" * 257 + b"]" * 257, True),
        (b'["' + b"[" * 300 + b'"]', False),  # brackets in a string do not nest
        (b'["\\"' + b"[" * 300 + b'"]', False),
        (b"[" + b",".join([b"[" * 200 + b"]" * 200] * 50) + b"]", False),
        (b'"\\ud800"', True),
        (b'{"a":"x\\uDFFFy"}', True),
        (b'"\\ud83d\\ude00"', False),  # a surrogate pair is one character
        (b'"\\\\ud800"', False),  # an escaped backslash, then text
        (b"\xef\xbb\xbf{}", True),  # a byte order mark is not JSON (RFC 8259 section 8.1)
        (b'{"a":1,"a":2}', True),
        (b"[NaN]", True),
        (b"[1e400]", True),
    ],
)
def test_strict_json_bounds_depth_and_refuses_lone_surrogates(body, refused):
    from webhook_receiver.fingerprint import JSONError, canonical_json, loads

    if refused:
        with pytest.raises(JSONError):
            loads(body)
    else:
        canonical_json(loads(body))


def test_a_source_that_takes_any_bytes_needs_no_content_type(make_app):
    source = {"provider": "generic", "secrets": [s.GENERIC_SECRET], "signature_header": "X-Sig"}
    client = make_app({"sources": {"raw": source}}).test_client()
    body = b"\x00\xffbinary"
    response = client.post(
        "/webhooks/raw",
        data=body,
        headers={"X-Sig": s.hmac_hex(body), "Idempotency-Key": "raw-1"},
        content_type=None,
    )
    assert response.status_code == 200, response.get_json()


@pytest.mark.slow
@pytest.mark.parametrize("size_line", [b"zz", b"ffffffffffffffffffff", b"-1", b"5;\rx"])
def test_a_malformed_chunk_size_is_a_400_on_every_path(server, size_line):
    for path, problem_json in [
        ("/webhooks/stripe-live", True),
        ("/api/events", True),
        ("/admin/login", False),
        ("/nowhere", False),
    ]:
        response = raw(
            server,
            b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + size_line
            + b"\r\nabc\r\n0\r\n\r\n",
        )
        assert response.status == 400, (path, response.status, response.body[:300])
        if problem_json:
            assert response.headers.get("content-type") == "application/problem+json", path
    assert requests.get(server.url + "/healthz", timeout=5).status_code == 200


@pytest.mark.slow
def test_a_body_refused_before_any_view_still_answers_the_request_id(server):
    # The chunked body is checked in the app's first before_request, ahead
    # of the one that takes the correlation id: its 400 (and the 413 of a
    # chunked body over the limit) went out without X-Request-Id, which every
    # answer carries, and its log lines without the id.
    for body, status in [
        (b"zz\r\nabc\r\n0\r\n\r\n", 400),
        (chunked(b"x" * (LIMIT + 1000)), 413),
    ]:
        response = raw(
            server,
            b"POST /api/events HTTP/1.1\r\nHost: x\r\nX-Request-Id: req-7\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + body,
        )
        assert response.status == status, response.body[:300]
        assert response.headers.get("x-request-id") == "req-7", response.headers
