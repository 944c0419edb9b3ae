"""The Pub/Sub consumer beyond the contract suite: redelivery, exactly-once, what is stored.

Against the Pub/Sub emulator (tests/pubsub_emulator.py), on both databases.
The contract suite (test_contract.py) holds it to every broker's promises.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import select

from webhook_receiver import config as cfg
from webhook_receiver.config.forwards import parse_forwards
from webhook_receiver.extensions import db
from webhook_receiver.models import Event
from webhook_receiver.processing import publishers

from ..helpers import brokers as shared
from ..helpers import rows
from ..helpers.brokers import FORWARDED
from . import cloud_examples
from .cloud_fixtures import PROJECT, Subscription, pubsub_source
from .conftest import (
    consuming,
    count_events,
    dead_letter_count,
    duplicate_total,
    rejections,
    stored_keys,
    wait_until,
)
from .running import hold_writers
from .test_poison import _HYPOTHESIS, _settled_total

SOURCE = "jobs"


def _message(n: int, **attributes: str) -> tuple[bytes, dict[str, str]]:
    return json.dumps({"n": n}).encode(), {"message-id": f"m-{n}", "type": "order", **attributes}


def test_messages_a_dead_consumer_pulled_come_back_after_the_ack_deadline(
    make_app, pubsub_subscription: Subscription
):
    # Another consumer pulls five and dies without acknowledging them: the
    # subscription redelivers them once its 10 s ack deadline has passed,
    # and each is stored once.
    subscription = pubsub_subscription
    subscription.publish([_message(n) for n in range(5)])
    taken = subscription.take(5)
    assert len(taken) == 5
    taken_at = time.monotonic()
    subscription.publish([_message(n) for n in range(5, 10)])
    app = make_app({"sources": {SOURCE: pubsub_source(subscription)}})
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 5, 30)
        time.sleep(max(0.0, taken_at + 7 - time.monotonic()))
        assert count_events(app) == 5  # still the dead consumer's, within its deadline
        assert wait_until(lambda: count_events(app) == 10, 30)
        assert wait_until(lambda: subscription.unacknowledged() == 0, 10)
    assert time.monotonic() - taken_at >= 10
    assert sorted(stored_keys(app)) == sorted(f"m-{n}" for n in range(10))
    assert duplicate_total(app) == 0


def test_on_an_exactly_once_subscription_every_acknowledgement_is_checked(make_app, pubsub_host):
    subscription = Subscription(f"wr-test-eod-{time.monotonic_ns() % 10**9}")
    subscription.create(enable_exactly_once_delivery=True)
    try:
        subscription.publish([_message(n) for n in range(20)] + [_message(3)])
        app = make_app({"sources": {SOURCE: pubsub_source(subscription)}})
        with consuming(app, SOURCE):
            assert wait_until(lambda: count_events(app) == 20, 30)
            assert wait_until(lambda: duplicate_total(app) == 1, 30)
            assert wait_until(lambda: subscription.unacknowledged() == 0, 10)
    finally:
        subscription.delete()


def test_without_a_dead_letter_topic_a_poison_message_is_nacked_to_the_subscription_s_policy(
    make_app, pubsub_host
):
    subscription = Subscription(f"wr-test-dlp-{time.monotonic_ns() % 10**9}")
    policy_topic = f"{subscription.topic}-policy"
    from google.cloud import pubsub_v1

    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    publisher.create_topic(name=policy_topic)
    subscriber.create_subscription(name=f"{subscription.path}-policy", topic=policy_topic)
    subscription.create(
        dead_letter_policy={"dead_letter_topic": policy_topic, "max_delivery_attempts": 5}
    )
    try:
        source = pubsub_source(subscription)
        del source["dead_letter_topic"]
        app = make_app({"sources": {SOURCE: source}})
        subscription.publish([_message(1), (b'{"n": 0}', {"type": "order"}), _message(2)])
        with consuming(app, SOURCE):
            assert wait_until(lambda: count_events(app) == 2, 30)
            assert wait_until(lambda: subscription.unacknowledged() == 0, 30)
        moved = Subscription._pull_all(subscriber, f"{subscription.path}-policy", acknowledge=True)
        assert [r.message.data for r in moved] == [b'{"n": 0}']
        assert "dead-letter-reason" not in moved[0].message.attributes
    finally:
        subscriber.delete_subscription(subscription=f"{subscription.path}-policy")
        publisher.delete_topic(topic=policy_topic)
        subscriber.close()
        subscription.delete()


def test_what_is_stored_of_a_message_its_attributes_and_where_it_came_from(
    make_app, pubsub_subscription: Subscription
):
    subscription = pubsub_subscription
    subscription.publish([_message(1, **{"content-type": "application/json", "tenant": "acme"})])
    app = make_app({"sources": {SOURCE: pubsub_source(subscription)}})
    event = shared.consume_one(app, SOURCE)
    assert (event.dedup_key, event.event_type, event.content_type) == (
        "m-1",
        "order",
        "application/json",
    )
    assert dict(event.headers)["tenant"] == "acme"
    assert event.meta["broker"] == "pubsub"
    assert event.meta["subscription"] == subscription.path
    assert event.meta["message_id"] == event.meta["properties"]["message_id"]
    assert event.meta["publish_time"]


def test_the_default_key_is_the_message_id_pub_sub_gave_the_message(
    make_app, pubsub_subscription: Subscription
):
    subscription = pubsub_subscription
    subscription.publish([(b"plain text", {}), (b"plain text", {})])
    source = pubsub_source(subscription)
    del source["dedup_key"], source["event_type"]
    app = make_app({"sources": {SOURCE: source}})
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 2, 30)
    with app.app_context():
        events = db.session.execute(select(Event)).scalars().all()
    # Two publishes are two messages, whatever their bytes; each id is Pub/Sub's.
    assert {e.dedup_key for e in events} == {e.meta["message_id"] for e in events}
    assert {e.event_type for e in events} == {None}


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ({"subscription": "jobs"}, "project must be a Google Cloud project id"),
        ({"project": "my-project"}, "subscription must name"),
        ({"project": "my-project", "subscription": "projects/p/topics/jobs"}, "subscription"),
        ({"project": "my-project", "subscription": "jobs", "dead_letter_topic": "x/y"}, "topic"),
        ({"project": "my-project", "subscription": "jobs", "dedup_key": "offset"}, "'message_id'"),
        (
            {"project": "my-project", "subscription": "jobs", "dedup_key": "deduplication_id"},
            "'attribute:<name>'",
        ),
    ],
)
def test_a_wrong_pubsub_source_is_refused_with_a_line_naming_it(table, problem):
    shared.assert_source_refused(problem, provider="pubsub", **table)


def test_the_issue_s_pubsub_source_names_its_subscription_and_dead_letter_topic_in_full():
    source = shared.parse_source(
        provider="pubsub",
        project="my-project",
        subscription="jobs-receiver",
        event_type="attribute:type",
        dead_letter_topic="",
    ).brokers["jobs"]
    assert source.subscription == "projects/my-project/subscriptions/jobs-receiver"
    assert source.dead_letter_topic is None
    assert (source.dedup_key, source.batch) == ("message_id", 200)
    dead = shared.parse_source(
        provider="pubsub", project="my-project", subscription="jobs", dead_letter_topic="jobs.dead"
    ).brokers["jobs"]
    assert dead.dead_letter_topic == "projects/my-project/topics/jobs.dead"


def test_the_docs_worked_example_runs_as_written(make_app, pubsub_host):
    name, table, commands = cloud_examples.example("Google Cloud Pub/Sub")
    tag = f"wr-test-{uuid.uuid4().hex[:10]}"
    table = {**table, "subscription": f"{tag}-receiver", "dead_letter_topic": f"{tag}.dead"}
    swap = {"jobs.dead": f"{tag}.dead", "jobs-receiver": f"{tag}-receiver"}
    app = make_app({"sources": {name: table}})
    project = f"projects/{table['project']}"
    try:
        shared.run_cloud_example(app, name, commands, swap)
        # Declared again, everything exists.
        again = app.test_cli_runner().invoke(args=["brokers", "declare", name])
        assert again.exit_code == 0, again.output
        assert [line.rsplit(": ", 1)[1] for line in again.output.splitlines()] == [
            "exists",
            "exists",
            "exists",
        ]
    finally:
        from google.cloud import pubsub_v1

        publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        for path in (f"{tag}-receiver", f"{tag}.dead"):
            subscriber.delete_subscription(subscription=f"{project}/subscriptions/{path}")
            publisher.delete_topic(topic=f"{project}/topics/{path}")
        subscriber.close()


def test_publish_to_a_subscription_never_declared_is_one_line_and_exit_status_1(
    make_app, pubsub_host
):
    source = pubsub_source(Subscription("wr-test-missing"))
    app = make_app({"sources": {SOURCE: source}})
    shared.assert_not_declared(shared.publish_order(app, SOURCE), SOURCE)


def _forward(topic: str) -> Any:
    project, name = topic.removeprefix("projects/").split("/topics/")
    [forward] = parse_forwards([{"name": "bus", "url": f"pubsub://{project}/{name}"}], "test")
    return forward


def test_a_forward_publishes_a_message_that_a_pubsub_source_reads_as_one_event(
    make_app, pubsub_subscription: Subscription
):
    subscription = pubsub_subscription
    forward = _forward(subscription.topic)
    publishers.publish(forward, FORWARDED)
    publishers.publish(forward, FORWARDED)  # a worker killed before marking it done
    app = make_app({"sources": {SOURCE: pubsub_source(subscription)}})
    with consuming(app, SOURCE):
        assert wait_until(lambda: duplicate_total(app) == 1, 30)
        assert wait_until(lambda: subscription.unacknowledged() == 0, 10)
    [event] = rows(app)
    shared.assert_forwarded(event)


def test_a_forward_to_a_topic_that_does_not_exist_is_retried(pubsub_host):
    forward = _forward(f"projects/{PROJECT}/topics/wr-test-missing-{uuid.uuid4().hex[:8]}")
    with pytest.raises(publishers.PublishError) as failed:
        publishers.publish(forward, FORWARDED)
    assert not isinstance(failed.value, publishers.PublishRefused)


@pytest.mark.parametrize(
    "url", ["pubsub://my-project", "pubsub://My_Project/jobs", "pubsub://my-project/a/b"]
)
def test_a_wrong_pubsub_forward_is_refused(url):
    with pytest.raises(cfg.ConfigError, match="pubsub://<project>/<topic>"):
        parse_forwards([{"name": "bus", "url": url}], "test")


_ATTRIBUTE_NAME = st.text(min_size=1, max_size=12).filter(lambda n: not n.startswith("goog"))


def test_arbitrary_data_and_attributes_never_stop_the_consumer(
    make_app, pubsub_subscription: Subscription
):
    subscription = pubsub_subscription
    app = make_app({"sources": {SOURCE: pubsub_source(subscription)}})
    with consuming(app, SOURCE):

        @_HYPOTHESIS
        @given(
            st.binary(max_size=24),
            st.dictionaries(_ATTRIBUTE_NAME, st.text(max_size=12), max_size=4),
            st.text(max_size=12),
        )
        def check(data: bytes, attributes: dict[str, str], key: str) -> None:
            before = _settled(app)
            crafted = {**attributes, "message-id": key}
            subscription.publish([(data, crafted), _message(uuid.uuid4().int % 10**9)])
            # The crafted message is stored or dead-lettered, and the marker behind it stored.
            assert wait_until(lambda: _settled(app) - before >= 2, 20), crafted

        check()
        assert wait_until(lambda: subscription.unacknowledged() == 0, 10)


def test_a_poison_message_whose_attributes_are_named_like_publish_s_arguments_is_dead_lettered(
    make_app, pubsub_subscription: Subscription
):
    # The client's publish() takes attributes as keyword arguments beside
    # its own: a copy carrying "topic" or "timeout" must still go out whole.
    subscription = pubsub_subscription
    app = make_app({"sources": {SOURCE: pubsub_source(subscription)}})
    reserved = {"topic": "t", "data": "d", "ordering_key": "o", "retry": "r", "timeout": "9"}
    subscription.publish([(b"not json", {"type": "order", **reserved})])
    with consuming(app, SOURCE):
        dead = _copies(subscription, 20)
    [copy] = dead
    assert copy.data == b"not json"
    assert {name: copy.attributes[name] for name in reserved} == reserved
    assert copy.attributes["dead-letter-reason"] == "dedup-key-missing"
    assert count_events(app) == 0
    assert subscription.unacknowledged() == 0


def _settled(app: Any) -> float:
    """Messages stored, counted as duplicates (an example may repeat one) or dead-lettered."""
    return _settled_total(app, SOURCE) + duplicate_total(app)


def test_a_batch_held_past_half_its_ack_deadline_has_it_extended(
    make_app, db_url, pubsub_subscription: Subscription, caplog
):
    # The subscription's 10 s deadline (Pub/Sub's least), a store held for
    # 7 s: extended at 5 s (ModifyAckDeadline), nothing is redelivered.
    subscription = pubsub_subscription
    app = make_app({"sources": {SOURCE: pubsub_source(subscription)}})
    caplog.set_level(logging.INFO, "webhook_receiver.brokers.leases")
    release = hold_writers(db_url)
    try:
        with consuming(app, SOURCE):
            subscription.publish([_message(n) for n in range(10)])
            time.sleep(7)
            assert count_events(app) == 0
            release()
            release = None
            assert wait_until(lambda: count_events(app) == 10, 30)
            assert wait_until(lambda: subscription.unacknowledged() == 0, 10)
    finally:
        if release is not None:
            release()
    assert "messages held past half their ack deadline: extended by 10 s" in caplog.text
    assert "could not extend" not in caplog.text
    assert duplicate_total(app) == 0


@pytest.fixture
def dead_lettering(make_app, pubsub_subscription: Subscription, caplog) -> Any:
    """The source's app (its dead_letter_topic set), the brokers' WARNING lines captured."""
    app = make_app({"sources": {SOURCE: pubsub_source(pubsub_subscription)}})
    caplog.set_level(logging.WARNING, "webhook_receiver.brokers")
    return app


def _copies(subscription: Subscription, seconds: float) -> list[Any]:
    """The copies on the dead-letter topic, gathered until some came (each read takes them)."""
    dead: list[Any] = []
    assert wait_until(lambda: dead.extend(subscription.dead_letters()) or dead, seconds)
    return dead


def test_a_poison_message_with_100_attributes_is_dead_lettered_without_a_101st(
    dead_lettering, pubsub_subscription: Subscription, caplog
):
    # Pub/Sub takes 100 attributes per message at most (the emulator takes
    # more): the copy goes unchanged, its reason in the log. With a 101st
    # attribute Pub/Sub refused it (InvalidArgument), and the message was
    # given back and refused again, for ever.
    subscription = pubsub_subscription
    attributes = {"type": "order", **{f"a-{n}": str(n) for n in range(99)}}
    assert len(attributes) == 100
    subscription.publish([(b'{"n": 0}', attributes), _message(1)])
    app = dead_lettering
    with consuming(app, SOURCE):
        dead = _copies(subscription, 20)
        assert wait_until(lambda: count_events(app) == 1, 20)
        assert wait_until(lambda: subscription.unacknowledged() == 0, 10)
    [copy] = dead
    assert copy.data == b'{"n": 0}'
    assert dict(copy.attributes) == attributes
    assert "went without its dead-letter-reason attribute" in caplog.text
    assert "Pub/Sub's most of 100 attributes" in caplog.text
    assert dead_letter_count(app, SOURCE, "dedup-key-missing") == 1


def test_a_poison_message_s_own_dead_letter_reason_attribute_is_kept(
    dead_lettering, pubsub_subscription: Subscription, caplog
):
    subscription = pubsub_subscription
    attributes = {"type": "order", "dead-letter-reason": "the producer's"}
    subscription.publish([(b'{"n": 0}', attributes)])
    with consuming(dead_lettering, SOURCE):
        dead = _copies(subscription, 20)
        assert wait_until(lambda: subscription.unacknowledged() == 0, 10)
    [copy] = dead
    assert dict(copy.attributes) == attributes
    assert "the message has one of its own, kept" in caplog.text


def test_a_copy_pub_sub_refuses_as_too_large_is_sent_without_its_reason_or_not_at_all(
    dead_lettering, pubsub_subscription: Subscription, monkeypatch, caplog
):
    # Pub/Sub refuses a message over 10 MB (InvalidArgument); the emulator
    # takes more. A publish that refuses as Pub/Sub does, past 1,000 bytes
    # of data and attributes: a copy that fits only without its reason goes
    # so, and one that never fits is not published. Both were given back
    # and refused again, for ever.
    import google.api_core.exceptions as api_exceptions

    from webhook_receiver.brokers import pubsub as adapter

    subscription = pubsub_subscription
    near = (json.dumps({"pad": "x" * 958}).encode(), {"type": "order"})
    large = (json.dumps({"pad": "x" * 2000}).encode(), {"type": "order"})
    assert len(near[0]) + len("typeorder") == 978  # 1,013 with the reason attribute
    subscription.publish([near, large, _message(1)])
    publish = adapter.publish_exactly

    def as_pub_sub(publisher: Any, topic: str, data: bytes, attributes: Any, timeout: float) -> str:
        size = len(data) + sum(len(k) + len(v) for k, v in dict(attributes).items())
        if size > 1000:
            raise api_exceptions.InvalidArgument(
                f"Request payload size exceeds the limit: 1000 bytes ({size})."
            )
        return publish(publisher, topic, data, attributes, timeout)

    monkeypatch.setattr(adapter, "publish_exactly", as_pub_sub)
    app = dead_lettering
    with consuming(app, SOURCE):
        assert wait_until(lambda: count_events(app) == 1, 20)
        assert wait_until(lambda: dead_letter_count(app, SOURCE, "dedup-key-missing") == 2, 20)
        assert wait_until(lambda: subscription.unacknowledged() == 0, 10)
        dead = _copies(subscription, 10)
    [copy] = dead
    assert (copy.data, dict(copy.attributes)) == near
    assert "went without its dead-letter-reason attribute (refused with it" in caplog.text
    [refused] = [r for r in caplog.records if "was refused (" in r.getMessage()]
    assert refused.levelno == logging.ERROR
    assert "the message is acknowledged without one" in refused.getMessage()
    assert rejections(app, SOURCE) == {"dedup-key-missing": 2}


def test_a_pubsub_source_without_credentials_waits_saying_so_without_a_traceback(
    make_app, tmp_path, monkeypatch, caplog
):
    # No emulator and no application default credentials, as an operator
    # who has not run `gcloud auth application-default login` meets it: the
    # consumer failed with a traceback, and again at each restart.
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    table = {"provider": "pubsub", "project": PROJECT, "subscription": "jobs-receiver"}
    app = make_app({"sources": {SOURCE: table}})
    caplog.set_level(logging.INFO)
    with consuming(app, SOURCE):
        assert wait_until(lambda: "no credentials" in caplog.text, 10)
        time.sleep(1.5)  # a retry or two, within the first back-off
    said = [r for r in caplog.records if "no credentials" in r.getMessage()]
    # Said at once, then as an outage is (after growing waits), never as a failure.
    assert said and {r.levelno for r in said} == {logging.WARNING}
    assert "missing.json was not found" in said[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
