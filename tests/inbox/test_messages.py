"""The inbox's one boundary: Message.build checks what a message holds, for every intake.

PostgreSQL refuses a NUL in text, a lone surrogate and a value longer than
its column with an error, where SQLite stores them; Message.build refuses
them first, with one error (Unstorable) that each intake maps to its
protocol: a 400 (415 for the Content-Type) over HTTP, a dead letter for a
broker message.
"""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from webhook_receiver import inbox
from webhook_receiver.brokers.identify import PAYLOAD_INVALID, BrokerMessage, Unidentified, identify
from webhook_receiver.extensions import db
from webhook_receiver.inbox import Message
from webhook_receiver.inbox.messages import (
    CONTENT_TYPE_LENGTH,
    KEY_LENGTH,
    SOURCE_LENGTH,
    TYPE_LENGTH,
    Unstorable,
)
from webhook_receiver.models import Event

from ..conftest import CLIENTS
from ..helpers import RABBIT_SOURCE

FIELDS = {"source": "s", "dedup_key": "k", "fingerprint": "f" * 64, "body": b"{}"}


def build(**fields: object) -> Message:
    return Message.build(**{**FIELDS, **fields})  # type: ignore[arg-type]


def test_the_limits_are_the_columns():
    columns = Event.__table__.c
    assert KEY_LENGTH == columns.dedup_key.type.length == 512
    assert TYPE_LENGTH == columns.event_type.type.length == 255
    assert CONTENT_TYPE_LENGTH == columns.content_type.type.length == 255
    assert SOURCE_LENGTH == columns.source.type.length == 200


def test_a_storable_message_is_the_message():
    message = build(event_type="t" * TYPE_LENGTH, dedup_key="k" * KEY_LENGTH, meta={"a": "é"})
    assert message == Message(
        **{**FIELDS, "dedup_key": "k" * KEY_LENGTH},  # type: ignore[arg-type]
        event_type="t" * TYPE_LENGTH,
        meta={"a": "é"},
    )


@pytest.mark.parametrize(
    ("fields", "field", "reason"),
    [
        ({"dedup_key": ""}, "dedup_key", "empty"),
        ({"dedup_key": "k" * (KEY_LENGTH + 1)}, "dedup_key", "too-long"),
        ({"dedup_key": "k\x00"}, "dedup_key", "nul"),
        ({"dedup_key": "k\ud800"}, "dedup_key", "not-utf8"),
        ({"event_type": "t" * (TYPE_LENGTH + 1)}, "event_type", "too-long"),
        ({"event_type": "a\x00b"}, "event_type", "nul"),
        ({"content_type": "x" * (CONTENT_TYPE_LENGTH + 1)}, "content_type", "too-long"),
        ({"content_type": "text/plain\x00"}, "content_type", "nul"),
        ({"source": "s" * (SOURCE_LENGTH + 1)}, "source", "too-long"),
        ({"client": "c" * 201}, "client", "too-long"),
        ({"correlation_id": "c" * 201}, "correlation_id", "too-long"),
        ({"correlation_id": "\udc00"}, "correlation_id", "not-utf8"),
        ({"meta": {"delivery": "d\x00"}}, "meta", "nul"),
        # PostgreSQL's unique index takes 2704 bytes a row: four-byte characters
        # within the lengths in characters go past it.
        ({"source": "\U0001f600" * 160, "dedup_key": "\U0001f600" * 512}, "dedup_key", "too-long"),
        # jsonb refuses the whole document for one of these anywhere in it,
        # where SQLite stores it: a batch holding one failed on every redelivery.
        ({"headers": (("X-Note", "a\x00b"),)}, "headers", "nul"),
        ({"headers": (("X-\x00", "a"),)}, "headers", "nul"),
        ({"headers": (("X-Note", "a\ud800"),)}, "headers", "not-utf8"),
        ({"meta": {"nested": {"list": ["d\x00"]}}}, "meta", "nul"),
        ({"meta": {"k\x00": "v"}}, "meta", "nul"),
        ({"meta": {"nested": {"k\x00": 1}}}, "meta", "nul"),
        ({"meta": {"delivery": "\udc00"}}, "meta", "not-utf8"),
        ({"meta": {"nested": ["\ud800"]}}, "meta", "not-utf8"),
        # Past 4,300 digits Python writes no JSON of an integer, on either database.
        ({"meta": {"n": 10**4300}}, "meta", "too-long"),
        ({"meta": {"nested": [-(10**4300)]}}, "meta", "too-long"),
    ],
)
def test_what_no_database_stores_is_refused(fields, field, reason):
    with pytest.raises(Unstorable) as refused:
        build(**fields)
    assert (refused.value.field, refused.value.reason) == (field, reason)
    assert str(refused.value) == refused.value.detail


def test_a_key_at_the_unique_index_limit_is_stored_on_both_databases(make_app):
    # 2680 bytes of source name and key in UTF-8: what Message.build lets through.
    source = "".join(chr(0x10000 + 7919 * i % 0xFFFFF) for i in range(157)) + "abcd"
    key = "".join(chr(0x10000 + 7919 * i % 0xFFFFF) for i in range(200, 712))
    message = build(source=source, dedup_key=key)
    with pytest.raises(Unstorable):
        build(source=source + "c", dedup_key=key)
    app = make_app({"clients": CLIENTS, "sources": {}})
    with app.app_context():
        assert isinstance(inbox.receive(message), inbox.Accepted)


def test_what_build_lets_through_both_databases_store(make_app):
    app = make_app({"clients": CLIENTS, "sources": {}})
    fields = {
        "headers": (("X-Note", "é"), ("X-Empty", "")),
        "meta": {"é": {"list": ["ü", 2**70, 10**4299, 1.5, None, True]}, "n": -(2**63)},
    }
    with app.app_context():
        outcomes = inbox.receive_many([build(**fields), build(dedup_key="k2", **fields)])
        assert [type(o) for o in outcomes] == [inbox.Accepted, inbox.Accepted]
        stored = db.session.get(Event, outcomes[0].event_id)
        assert stored is not None
        assert stored.headers == [["X-Note", "é"], ["X-Empty", ""]]
        assert stored.meta == fields["meta"]


@pytest.mark.parametrize(
    "delivery",
    [
        BrokerMessage(body=b"{}", properties={"message_id": "k" * (KEY_LENGTH + 1)}),
        BrokerMessage(body=b"{}", properties={"message_id": "k\x00"}),
        BrokerMessage(body=b"{}", properties={"message_id": "k", "type": "t" * 256}),
        BrokerMessage(body=b"{}", properties={"message_id": "k"}, content_type="x" * 256),
        BrokerMessage(body=b"{}", properties={"message_id": "k"}, content_type="a/b\x00"),
    ],
)
def test_a_broker_message_over_a_limit_is_dead_lettered_as_payload_invalid(delivery):
    with pytest.raises(Unidentified) as refused:
        identify(RABBIT_SOURCE, delivery)
    assert refused.value.reason == PAYLOAD_INVALID


def test_a_broker_json_key_over_the_limit_is_payload_invalid():
    source = replace(RABBIT_SOURCE, dedup_key="json:/id")
    with pytest.raises(Unidentified) as refused:
        identify(source, BrokerMessage(body=b'{"id": "%s"}' % (b"k" * 513)))
    assert refused.value.reason == PAYLOAD_INVALID


def test_every_intake_builds_its_messages_through_the_boundary():
    package = Path(__file__).resolve().parents[2] / "webhook_receiver"
    direct = []
    for path in package.rglob("*.py"):
        if path.parent.name == "inbox":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in ("Message", "inbox.Message"):
                    direct.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    assert not direct, f"build messages with Message.build: {direct}"
