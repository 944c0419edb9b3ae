"""The NATS JetStream consumer against the real server: stored once, acked after the commit."""

from __future__ import annotations

import json

import pytest

from .conftest import (
    consuming,
    count_conflicts,
    count_events,
    dead_letter_count,
    duplicate_total,
    nats_source,
    wait_until,
)

SOURCE = "payments"


def _app(make_app, stream, **extra):
    return make_app({"sources": {SOURCE: nats_source(stream, **extra)}})


def _message(n: int, total: int | None = None):
    body = json.dumps({"payment": n, "total": total if total is not None else n}).encode()
    return "paid", body, {"Nats-Msg-Id": f"pay-{n}", "Content-Type": "application/json"}


def test_event_type_is_the_subject_and_content_is_kept(make_app, jetstream):
    app = _app(make_app, jetstream)
    jetstream.publish([_message(1)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
    from webhook_receiver.extensions import db
    from webhook_receiver.models import Event

    with app.app_context():
        event = db.session.query(Event).one()
        assert event.event_type == f"{jetstream.prefix}.paid"
        assert event.dedup_key == "pay-1"
        assert event.content_type == "application/json"
        assert event.body == _message(1)[1]
        assert ["Nats-Msg-Id", "pay-1"] in event.headers
        assert event.meta["subject"] == f"{jetstream.prefix}.paid"


def test_conflicting_message_kept_and_dead_lettered_with_its_reason(make_app, jetstream):
    app = _app(make_app, jetstream, dedup_key="json:/payment")
    jetstream.publish([_message(1)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        subject, body, headers = _message(1, total=999)
        jetstream.publish([(subject, body, {**headers, "Nats-Msg-Id": "other", "X-Shop": "a"})])
        assert wait_until(lambda: len(jetstream.dead_letters()) == 1, 30)
        assert wait_until(lambda: jetstream.pending() == (0, 0), 30)
    assert count_events(app) == 1
    assert count_conflicts(app) == 1
    [(data, dead_headers)] = jetstream.dead_letters()
    assert data == body
    assert dead_headers["Dead-Letter-Reason"] == "conflict"
    assert dead_headers["X-Shop"] == "a"
    assert dead_headers["Content-Type"] == "application/json"
    assert dead_headers["Dead-Letter-Msg-Id"] == "other"
    assert dead_letter_count(app, SOURCE, "conflict") == 1


def test_json_serialised_again_under_its_key_is_a_duplicate_not_a_conflict(make_app, jetstream):
    # Published again with other bytes of the same content (and past
    # JetStream's own duplicate window, under another Nats-Msg-Id): acked as
    # a duplicate. Other content is still a conflict.
    app = _app(make_app, jetstream, dedup_key="json:/payment")
    subject, body, headers = _message(1)
    respelled = json.dumps(json.loads(body), indent=1, sort_keys=True).encode()
    changed = json.dumps({"total": 2, "payment": 1}).encode()
    jetstream.publish([(subject, body, headers)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        jetstream.publish([(subject, respelled, {**headers, "Nats-Msg-Id": "pay-1-again"})])
        assert wait_until(lambda: duplicate_total(app) == 1 and jetstream.pending() == (0, 0), 30)
        jetstream.publish([(subject, changed, {**headers, "Nats-Msg-Id": "pay-1-changed"})])
        assert wait_until(lambda: count_conflicts(app) == 1 and jetstream.pending() == (0, 0), 30)
    assert count_events(app) == 1
    assert dead_letter_count(app, SOURCE, "conflict") == 1


def test_without_dead_letter_subject_a_conflict_is_terminated(make_app, jetstream):
    table = nats_source(jetstream, dedup_key="json:/payment")
    del table["dead_letter_subject"]
    app = make_app({"sources": {SOURCE: table}})
    _, body1, h1 = _message(1)
    _, body2, h2 = _message(1, total=5)
    jetstream.publish([("paid", body1, h1), ("paid", body2, {**h2, "Nats-Msg-Id": "x"})])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_conflicts(app) == 1, 30)
        assert wait_until(lambda: jetstream.pending() == (0, 0), 30)
    assert count_events(app) == 1
    assert jetstream.dead_letters() == []


def test_dead_letter_subject_inside_the_consumed_stream_is_not_consumed_again(make_app, jetstream):
    dead = f"{jetstream.prefix}.dead"
    app = _app(make_app, jetstream, dedup_key="json:/payment", dead_letter_subject=dead)
    _, body, headers = _message(1)
    _, other, _ = _message(1, total=2)
    jetstream.publish([("paid", body, headers), ("paid", other, {"Nats-Msg-Id": "second"})])
    with consuming(app, SOURCE):
        # The conflict's copy lands in the consumed stream and comes back:
        # settled without being stored, so it is not a conflict again.
        assert wait_until(lambda: count_conflicts(app) == 1, 30)
        assert wait_until(
            lambda: jetstream.pending() == (0, 0) and _stream_count(jetstream) == 3, 30
        )
    assert count_conflicts(app) == 1
    assert count_events(app) == 1


def _stream_count(stream) -> int:
    async def go(nc):
        return (await nc.jetstream().stream_info(stream.name)).state.messages

    return stream.run(go)


def test_a_conflict_published_with_an_expected_sequence_is_still_dead_lettered(make_app, jetstream):
    # The producer guarded its publish with Nats-Expected-Last-Subject-Sequence.
    # Copied onto the dead letter, that expectation failed the copy's publish
    # (the dead-letter subject has no such sequence), and the conflict was
    # nak-ed and sighted again for ever.
    app = _app(make_app, jetstream, dedup_key="json:/payment")
    jetstream.publish([_message(1)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        subject, body, headers = _message(1, total=999)
        guarded = {**headers, "Nats-Msg-Id": "other", "Nats-Expected-Last-Subject-Sequence": "1"}
        jetstream.publish([(subject, body, guarded)])
        assert wait_until(lambda: len(jetstream.dead_letters()) == 1, 30)
        assert wait_until(lambda: jetstream.pending() == (0, 0), 30)
    assert count_conflicts(app) == 1
    [(data, dead_headers)] = jetstream.dead_letters()
    assert data == body
    assert "Nats-Expected-Last-Subject-Sequence" not in dead_headers
    assert dead_headers["Dead-Letter-Msg-Id"] == "other"


def test_dead_letter_that_could_not_be_published_comes_back_and_counts_once(
    make_app, jetstream, monkeypatch
):
    from webhook_receiver.brokers import jetstream as consumer_module

    monkeypatch.setattr(consumer_module, "DEAD_LETTER_RETRY_SECONDS", 0.3)
    # No stream is bound to this subject yet: the copy's publish finds no responder.
    nowhere = f"{jetstream.prefix}-nowhere"
    app = _app(make_app, jetstream, dead_letter_subject=nowhere)
    missing_key = "dedup-key-missing"

    jetstream.publish([("paid", b"no id here", {})])
    with consuming(app, SOURCE):
        # Tried and retried, never settled: not counted as dead-lettered.
        assert wait_until(lambda: jetstream.delivered() >= 3, 30)
        assert dead_letter_count(app, SOURCE, missing_key) == 0
        assert jetstream.pending()[1] == 1
        jetstream.add_stream("NOWHERE", nowhere)
        assert wait_until(lambda: jetstream.pending() == (0, 0), 30)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, missing_key) == 1, 10)
    assert count_events(app) == 0
    [(data, headers)] = jetstream.messages("NOWHERE")
    assert data == b"no id here"
    assert headers["Dead-Letter-Reason"] == "dedup-key-missing"
    assert dead_letter_count(app, SOURCE, missing_key) == 1


def _add_durable(stream, **config):
    from nats.js.api import AckPolicy, ConsumerConfig

    async def go(nc):
        settings = {"durable_name": "webhook-receiver", "ack_policy": AckPolicy.EXPLICIT}
        await nc.jetstream().add_consumer(stream.name, ConsumerConfig(**{**settings, **config}))

    stream.run(go)


@pytest.mark.parametrize(
    ("durable", "expected"),
    [
        ({"filter_subject": "PREFIX.refunds"}, "filters PREFIX.refunds, but filter_subject is "),
        ({"ack_policy": "none"}, "acknowledges"),
        ({"deliver_subject": "push-PREFIX"}, "is a push consumer"),
    ],
    ids=["other-filter", "acked-on-delivery", "push"],
)
def test_an_existing_durable_that_breaks_the_contract_is_refused_and_waited_on(
    make_app, jetstream, durable, expected, caplog
):
    from nats.js.api import AckPolicy

    config = {k: v.replace("PREFIX", jetstream.prefix) for k, v in durable.items()}
    if config.get("ack_policy") == "none":
        config["ack_policy"] = AckPolicy.NONE
    _add_durable(jetstream, **config)
    app = _app(make_app, jetstream, filter_subject=f"{jetstream.prefix}.paid")
    jetstream.publish([_message(1)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: "stream unavailable" in caplog.text, 10)
    assert expected.replace("PREFIX", jetstream.prefix) in caplog.text
    assert "nats consumer rm" in caplog.text
    assert count_events(app) == 0  # nothing consumed through a durable that breaks the contract


def test_an_existing_durable_with_the_configured_filter_is_used(make_app, jetstream):
    _add_durable(jetstream, filter_subject=f"{jetstream.prefix}.paid", ack_wait=7)
    app = _app(make_app, jetstream, filter_subject=f"{jetstream.prefix}.paid")
    jetstream.publish([_message(1)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
    assert jetstream.pending() == (0, 0)


def test_an_existing_durable_with_a_delivery_limit_is_used_and_warned_about(
    make_app, jetstream, caplog
):
    # Every nak counts towards max_deliver: past it a message is never stored.
    _add_durable(jetstream, filter_subject=f"{jetstream.prefix}.paid", max_deliver=5)
    app = _app(make_app, jetstream, filter_subject=f"{jetstream.prefix}.paid")
    jetstream.publish([_message(1)])
    with caplog.at_level("WARNING", logger="webhook_receiver"), consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
    assert "has max_deliver 5" in caplog.text


def test_a_dead_letter_subject_no_stream_takes_is_warned_about_at_start(
    make_app, jetstream, caplog
):
    app = _app(make_app, jetstream, dead_letter_subject=f"{jetstream.prefix}-nowhere")
    jetstream.publish([_message(1)])
    with caplog.at_level("WARNING", logger="webhook_receiver"), consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
    assert "no stream takes dead_letter_subject" in caplog.text


def _shrink_dead_letter_stream(jetstream, limit: int) -> int:
    """Set the dead-letter stream's max_msg_size to ``limit``; the size it now has."""

    async def shrink(nc):
        js = nc.jetstream()
        config = (await js.stream_info(jetstream.name + "_DEAD")).config
        config.max_msg_size = limit
        await js.update_stream(config)
        return (await js.stream_info(jetstream.name + "_DEAD")).config.max_msg_size

    return jetstream.run(shrink)


@pytest.mark.parametrize("fits", ["without-its-reason", "never"])
@pytest.mark.parametrize("limit_of", ["server", "dead-letter-stream"])
def test_a_poison_message_whose_copy_is_past_a_size_limit_does_not_loop(
    make_app, jetstream, monkeypatch, caplog, fits, limit_of
):
    # The server counts headers and data against max_payload; nats-py checks
    # the data alone. A message whose data nearly fills it, its copy's added
    # headers past it: the server refused the publish and closed the
    # connection, and the message was nak-ed and refused again, for ever.
    # The dead-letter stream may take smaller messages than the server
    # (max_msg_size; headers count there too): its refusal (JetStream error
    # 10054) was taken for a broker away, with the same loop. A copy that
    # fits without Dead-Letter-Reason goes so; one that never fits is never
    # published, and the message is terminated.
    from webhook_receiver.brokers import jetstream as consumer_module

    monkeypatch.setattr(consumer_module, "DEAD_LETTER_RETRY_SECONDS", 0.3)

    async def max_payload(nc):
        return nc.max_payload

    if limit_of == "server":
        limit = jetstream.run(max_payload)
    else:
        limit = _shrink_dead_letter_stream(jetstream, 2048)
        assert limit == 2048
    # The copy's own Nats-Msg-Id (the message is the stream's first) fits;
    # its Dead-Letter-Reason (39 bytes) does not.
    msg_id = f"Nats-Msg-Id: dead-letter:{jetstream.name}:1\r\n"
    size = limit - len("NATS/1.0\r\n\r\n") - len(msg_id) - 20 if fits != "never" else limit - 16
    app = _app(make_app, jetstream)
    caplog.set_level("WARNING", "webhook_receiver.brokers")
    jetstream.publish([("paid", b"x" * size, {}), _message(1)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        assert wait_until(lambda: jetstream.pending() == (0, 0), 30)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "dedup-key-missing") == 1, 10)
    assert jetstream.delivered() == 2  # never redelivered
    assert "connection" not in caplog.text
    assert "could not dead-letter" not in caplog.text
    if fits == "never":
        assert jetstream.dead_letters() == []
        [refused] = [r for r in caplog.records if "was refused (" in r.getMessage()]
        assert refused.levelname == "ERROR"
        assert "terminated without one" in refused.getMessage()
    else:
        [(data, headers)] = jetstream.dead_letters()
        assert data == b"x" * size
        assert "Dead-Letter-Reason" not in headers
        [warning] = [r for r in caplog.records if "Dead-Letter-Reason header" in r.getMessage()]
        assert warning.levelname == "WARNING"
        assert "was refused (" not in caplog.text


@pytest.mark.parametrize("own", ["Dead-Letter-Reason", "Dead-Letter-Msg-Id"])
def test_a_dead_letter_keeps_the_producers_own_dead_letter_headers_and_says_so(
    make_app, jetstream, caplog, own
):
    # A message redriven from a dead-letter stream carries our headers of
    # its own. The copy replaced the producer's Dead-Letter-Reason, and its
    # Dead-Letter-Msg-Id with the message's Nats-Msg-Id. nats-py sends a
    # header name once (a dict) and reads a repeated one as its last, so
    # ours cannot go beside theirs: the copy keeps theirs, as SQS's and
    # Pub/Sub's do, and a WARNING gives our reason and the Nats-Msg-Id.
    app = _app(make_app, jetstream, dedup_key="json:/payment")
    caplog.set_level("WARNING", "webhook_receiver.brokers")
    jetstream.publish([_message(1)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        subject, body, headers = _message(1, total=999)
        sent = {**headers, "Nats-Msg-Id": "other", own: "the producer's own"}
        jetstream.publish([(subject, body, sent)])
        assert wait_until(lambda: len(jetstream.dead_letters()) == 1, 30)
        assert wait_until(lambda: jetstream.pending() == (0, 0), 30)
    assert dead_letter_count(app, SOURCE, "conflict") == 1
    [(data, dead_headers)] = jetstream.dead_letters()
    assert data == body
    assert dead_headers[own] == "the producer's own"
    assert dead_headers["Nats-Msg-Id"] == f"dead-letter:{jetstream.name}:2"
    if own == "Dead-Letter-Reason":
        assert dead_headers["Dead-Letter-Msg-Id"] == "other"
    else:
        assert dead_headers["Dead-Letter-Reason"] == "conflict"
    [warning] = [r for r in caplog.records if f"went without its {own} header" in r.getMessage()]
    assert warning.levelname == "WARNING"
    assert "'other'" in warning.getMessage() and "conflict" in warning.getMessage()


def test_a_copy_past_a_size_limit_never_drops_the_producers_own_reason(make_app, jetstream, caplog):
    # Past the dead-letter stream's max_msg_size, a copy goes without the
    # Dead-Letter-Reason we add. The producer's own is not ours to drop: a
    # copy that fits only without it is never published (the message is
    # terminated with an ERROR line), never published changed.
    assert _shrink_dead_letter_stream(jetstream, 2048) == 2048
    reason = "redriven: " + "r" * 60
    theirs = f"Dead-Letter-Reason: {reason}\r\n"
    msg_id = f"Nats-Msg-Id: dead-letter:{jetstream.name}:1\r\n"
    # Past the limit by 10 bytes with their header, within it without.
    size = 2048 - len("NATS/1.0\r\n\r\n") - len(theirs) - len(msg_id) + 10
    app = _app(make_app, jetstream)
    caplog.set_level("WARNING", "webhook_receiver.brokers")
    jetstream.publish([("paid", b"x" * size, {"Dead-Letter-Reason": reason}), _message(1)])
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 30)
        assert wait_until(lambda: jetstream.pending() == (0, 0), 30)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "dedup-key-missing") == 1, 10)
    assert jetstream.delivered() == 2  # never redelivered
    assert jetstream.dead_letters() == []
    [refused] = [r for r in caplog.records if "was refused (" in r.getMessage()]
    assert refused.levelname == "ERROR" and "terminated without one" in refused.getMessage()
