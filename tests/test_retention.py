"""Retention: ``flask purge`` and the start-up refusal of too short a retention."""

from __future__ import annotations

import subprocess
import sys
import threading
import traceback
from datetime import timedelta

import pytest
from sqlalchemy import insert, select, text
from sqlalchemy import inspect as sa_inspect

from webhook_receiver import create_app
from webhook_receiver.config import ConfigError
from webhook_receiver.extensions import db
from webhook_receiver.models import (
    AdminLoginFailure,
    Delivery,
    Event,
    EventConflict,
    EventDuplicate,
    IdempotencyRecord,
    Rejection,
    utcnow,
)
from webhook_receiver.outbox import deliveries
from webhook_receiver.retention import PurgeReport, purge

from .conftest import CLIENTS, SECRET_KEY
from .helpers import count, event_row, waited_on_a_lock
from .servers import ROOT, app_env

GENERIC = {"provider": "generic", "secrets": ["s" * 16], "signature_header": "X-Sig"}
SOURCES = {"short": {**GENERIC, "retention_days": 3}, "long": {**GENERIC, "retention_days": 90}}
CONFIG = {"sources": SOURCES, "clients": CLIENTS}


@pytest.fixture
def app(make_app):
    return make_app(CONFIG)


def add_event(source: str, age_days: float, deliveries: tuple[str, ...] = ()) -> int:
    now = utcnow()
    received = now - timedelta(days=age_days)
    event_id = db.session.execute(
        insert(Event.__table__)
        .values(event_row(source=source, event_type="t", received_at=received))
        .returning(Event.__table__.c.id)
    ).scalar_one()
    for n, state in enumerate(deliveries):
        db.session.add(
            Delivery(
                event_id=event_id,
                consumer=f"c{n}",
                kind="handler",
                state=state,
                attempts=1,
                next_attempt_at=received,
                created_at=received,
                updated_at=received,
            )
        )
    db.session.commit()
    return event_id


def surviving_ids() -> set[int]:
    return set(db.session.scalars(select(Event.id)))


def test_events_go_after_their_sources_retention(app, runner):
    with app.app_context():
        keep = {
            add_event("short", 2),
            add_event("long", 60),
            add_event("api:acme", 29),
            add_event("gone", 29),
        }
        drop = {
            add_event("short", 4),
            add_event("long", 91),
            add_event("api:acme", 31),
            add_event("api:globex", 45),
            add_event("gone", 31),  # a source since removed from the config: the default
        }
    result = runner.invoke(args=["purge"])
    assert result.exit_code == 0, result.output
    assert "purged 5 event(s) past retention" in result.output
    assert "(unconfigured): 1" in result.output and "short: 1" in result.output
    with app.app_context():
        assert surviving_ids() == keep
        assert not surviving_ids() & drop


def test_api_and_default_retention_are_settings(make_app):
    app = make_app(CONFIG, API_RETENTION_DAYS=5, DEFAULT_RETENTION_DAYS=200)
    with app.app_context():
        kept = add_event("gone", 100)
        add_event("api:acme", 6)
        report = purge(utcnow(), 100)
        assert report.events == 1
        assert surviving_ids() == {kept}


def test_an_event_with_an_unfinished_delivery_is_never_purged(app, runner):
    with app.app_context():
        blocked = {
            add_event("short", 10, ("pending",)),
            add_event("short", 10, ("in_progress",)),
            add_event("short", 10, ("dead",)),
            add_event("short", 10, ("delivered", "dead")),
        }
        done = {
            add_event("short", 10, ("delivered",)),
            add_event("short", 10, ("skipped", "delivered")),
            add_event("short", 10),
        }
    result = runner.invoke(args=["purge", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    assert "purged 3 event(s)" in result.output
    assert "kept 4 event(s) past retention" in result.output
    with app.app_context():
        assert surviving_ids() == blocked
        assert count(app, Delivery) == 5  # the final deliveries went with their events
        # Once its deliveries are final, the event goes on the next run.
        db.session.execute(
            Delivery.__table__.update()
            .where(Delivery.event_id.in_(blocked))
            .values(state="delivered")
        )
        db.session.commit()
        assert purge(utcnow(), 2).events == 4
        assert surviving_ids() == set() and count(app, Delivery) == 0
        assert not done & surviving_ids()


def test_a_discarded_dead_letter_lets_its_event_go(app, runner):
    with app.app_context():
        discarded = add_event("short", 10, ("delivered", "dead"))
        still_dead = add_event("short", 10, ("dead",))
        dead_id = db.session.scalar(
            select(Delivery.id).where(Delivery.event_id == discarded, Delivery.state == "dead")
        )
        assert [d.id for d in deliveries.discard([dead_id], utcnow())] == [dead_id]
        db.session.commit()
    result = runner.invoke(args=["purge"])
    assert result.exit_code == 0, result.output
    assert "purged 1 event(s) past retention (short: 1)" in result.output
    assert "kept 1 event(s) past retention" in result.output
    assert "not delivered, skipped or discarded yet" in result.output
    with app.app_context():
        # The dead letter nobody discarded is kept; the discarded one went with its event.
        assert surviving_ids() == {still_dead}
        assert set(db.session.scalars(select(Delivery.state))) == {"dead"}


def test_duplicates_and_conflicts_cascade_with_their_event(app):
    with app.app_context():
        old = add_event("short", 5)
        new = add_event("short", 1)
        now = utcnow()
        for event_id in (old, new):
            db.session.add(EventDuplicate(event_id=event_id, received_at=now))
            add_conflict(event_id, reviewed=True)  # unreviewed, it would keep its event
        assert purge(utcnow(), 1000).events == 1
        assert db.session.scalars(select(EventDuplicate.event_id)).all() == [new]
        assert db.session.scalars(select(EventConflict.event_id)).all() == [new]


def add_conflict(event_id: int, reviewed: bool) -> None:
    now = utcnow()
    db.session.add(
        EventConflict(
            event_id=event_id,
            source="short",
            dedup_key="k",
            fingerprint="2" * 64,
            body=b"other",
            headers=[],
            received_at=now,
            last_seen_at=now,
            seen_count=1,
            reviewed_at=now if reviewed else None,
        )
    )
    db.session.commit()


def test_an_event_with_a_conflict_under_review_is_kept(app, runner):
    # A conflict is kept for an operator to review: one that came an hour
    # ago under an old event's key went with the event at the next purge,
    # before anyone saw it.
    with app.app_context():
        under_review = add_event("short", 10)
        add_conflict(under_review, reviewed=False)
        reviewed = add_event("short", 10)
        add_conflict(reviewed, reviewed=True)
    result = runner.invoke(args=["purge"])
    assert result.exit_code == 0, result.output
    assert "purged 1 event(s) past retention (short: 1)" in result.output
    assert "kept 1 event(s) past retention" in result.output
    assert "a conflict not reviewed yet" in result.output
    with app.app_context():
        assert surviving_ids() == {under_review}
        assert db.session.scalars(select(EventConflict.event_id)).all() == [under_review]
        # Once reviewed, the event and its conflict go on the next run.
        db.session.execute(EventConflict.__table__.update().values(reviewed_at=utcnow()))
        db.session.commit()
        assert purge(utcnow(), 10).events == 1
        assert surviving_ids() == set() and count(app, EventConflict) == 0


def test_batches_walk_past_kept_rows(app):
    with app.app_context():
        kept = set()
        for n in range(13):
            if n % 3 == 0:
                kept.add(add_event("short", 10 + n, ("dead",)))
            else:
                add_event("short", 10 + n)
        report = purge(utcnow(), 2)
        assert (report.events, report.events_kept) == (8, 5)
        assert surviving_ids() == kept


def test_idempotency_records_rejections_and_login_failures_are_pruned(app, runner):
    with app.app_context():
        now = utcnow()
        for key, expires in (("old", now - timedelta(seconds=1)), ("live", now + timedelta(1))):
            db.session.add(
                IdempotencyRecord(
                    client="acme",
                    key=key,
                    fingerprint="f" * 64,
                    method="POST",
                    path="/api/events",
                    state="completed",
                    created_at=now - timedelta(days=1),
                    expires_at=expires,
                )
            )
        for source, age in (("short", 4), ("short", 2), ("long", 60), ("gone", 31)):
            db.session.add(
                Rejection(source=source, reason="signature", received_at=now - timedelta(age))
            )
        for age in (31, 1):
            db.session.add(AdminLoginFailure(remote_addr="1.2.3.4", at=now - timedelta(age)))
        db.session.commit()
    result = runner.invoke(args=["purge", "--batch-size", "1"])
    assert result.exit_code == 0, result.output + "".join(
        traceback.format_exception(*result.exc_info) if result.exc_info else []
    )
    assert "purged 1 expired idempotency record(s)" in result.output
    assert "purged 2 rejection(s)" in result.output
    assert "purged 1 admin login failure(s)" in result.output
    with app.app_context():
        assert db.session.scalars(select(IdempotencyRecord.key)).all() == ["live"]
        assert sorted(
            (r.source, round((utcnow() - r.received_at).days))
            for r in db.session.scalars(select(Rejection))
        ) == [("long", 60), ("short", 2)]
        assert count(app, AdminLoginFailure) == 1


@pytest.mark.parametrize("size", ["-1", "0"])
def test_batch_size_must_be_positive(app, runner, size):
    # 0 too: it was taken for "not given", and the purge ran with the default.
    result = runner.invoke(args=["purge", "--batch-size", size])
    assert result.exit_code != 0
    assert "must be at least 1" in result.output
    assert "purged" not in result.output


def test_flask_purge_runs_from_the_command_line(db_url, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(
        '[sources.short]\nprovider = "generic"\nsecrets = ["ssssssssssssssss"]\n'
        'signature_header = "X-Sig"\nretention_days = 3\n'
    )
    app = create_app(
        {
            "TESTING": True,
            "SECRET_KEY": SECRET_KEY,
            "SQLALCHEMY_DATABASE_URI": db_url,
            "CONFIG": str(config),
        }
    )
    with app.app_context():
        add_event("short", 4)
        add_event("short", 1)
        db.session.remove()
        db.engine.dispose()
    done = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "wsgi", "purge", "--batch-size", "10"],
        cwd=ROOT,
        env=app_env(db_url, config),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "purged 1 event(s) past retention (short: 1)" in done.stdout


@pytest.mark.parametrize("days", [1, 2])
def test_start_up_refuses_retention_shorter_than_redelivery(tmp_path, days):
    source = {**SOURCES["short"], "retention_days": days}
    config = {
        "TESTING": True,
        "SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path}/x.sqlite3",
        "RECEIVER_CONFIG": {"sources": {"short": source}},
    }
    with pytest.raises(ConfigError, match="retention_days = .* shorter than"):
        create_app(config)
    assert create_app({**config, "FORCE_SHORT_RETENTION": True}).config["FILE_CONFIG"]
    # Three days, the providers' redelivery window, is allowed.
    create_app({**config, "RECEIVER_CONFIG": {"sources": {"short": SOURCES["short"]}}})


def _purge_while_a_write_waits(app, write: str, params: dict) -> PurgeReport:
    """Run ``write`` uncommitted on another connection, purge meanwhile, then commit it.

    The purge's DELETE waits on the row that the write holds; the write
    commits once it does, as a replay or a takeover committing while the
    purge runs.
    """
    report: list[PurgeReport] = []

    def run_purge() -> None:
        with app.app_context():
            report.append(purge(utcnow(), 10))

    with db.engine.connect() as writer:
        writer.execute(text(write), params)  # in its transaction: not committed
        thread = threading.Thread(target=run_purge)
        thread.start()
        waited = waited_on_a_lock(db.engine, thread)
        writer.commit()
        thread.join(30)
    assert waited and not thread.is_alive() and report
    return report[0]


def test_a_purge_keeps_an_idempotency_record_taken_over_while_it_waited(app):
    # An expired record is taken over (the same row, a new claim and
    # expiry) while the purge's DELETE waits on it: the DELETE checks the
    # expiry again on the row it would delete, and leaves the live claim.
    with app.app_context():
        if db.engine.dialect.name == "sqlite":
            pytest.skip("SQLite has one writer at a time: nothing commits while the purge waits")
        now = utcnow()
        db.session.add(
            IdempotencyRecord(
                client="acme",
                key="k",
                fingerprint="f" * 64,
                method="POST",
                path="/api/events",
                state="completed",
                created_at=now - timedelta(days=2),
                expires_at=now - timedelta(seconds=1),
            )
        )
        db.session.commit()
        report = _purge_while_a_write_waits(
            app,
            "UPDATE idempotency_records SET state = 'in_progress', expires_at = :later "
            "WHERE key = 'k'",
            {"later": now + timedelta(days=1)},
        )
        assert report.idempotency_records == 0
        assert db.session.scalars(select(IdempotencyRecord.state)).all() == ["in_progress"]


def test_a_purge_keeps_an_event_replayed_while_it_waited(app):
    # An old event's delivered delivery is set pending again (a replay)
    # while the purge's DELETE of the event waits on it: the event and its
    # pending delivery stay.
    with app.app_context():
        if db.engine.dialect.name == "sqlite":
            pytest.skip("SQLite has one writer at a time: nothing commits while the purge waits")
        event_id = add_event("short", 10, ("delivered",))
        report = _purge_while_a_write_waits(
            app,
            "UPDATE deliveries SET state = 'pending' WHERE event_id = :event_id",
            {"event_id": event_id},
        )
        assert (report.events, report.events_kept) == (0, 0)
        assert surviving_ids() == {event_id}
        assert db.session.scalars(select(Delivery.state)).all() == ["pending"]


def test_a_purge_keeps_an_event_whose_conflict_is_kept_while_it_waited(app):
    # A conflicting delivery is kept under an old event while the purge's
    # DELETE of the event waits on it: the event and the conflict stay.
    with app.app_context():
        if db.engine.dialect.name == "sqlite":
            pytest.skip("SQLite has one writer at a time: nothing commits while the purge waits")
        event_id = add_event("short", 10, ("delivered",))
        now = utcnow()
        report = _purge_while_a_write_waits(
            app,
            "INSERT INTO event_conflicts (event_id, source, dedup_key, fingerprint, body, "
            "headers, received_at, last_seen_at, seen_count) VALUES (:event_id, 'short', 'k', "
            ":fingerprint, :body, '[]', :now, :now, 1)",
            {"event_id": event_id, "fingerprint": "2" * 64, "body": b"other", "now": now},
        )
        assert (report.events, report.events_kept) == (0, 0)
        assert surviving_ids() == {event_id}
        assert db.session.scalars(select(EventConflict.event_id)).all() == [event_id]


def test_every_foreign_key_to_events_is_indexed(app):
    # Each event the purge deletes makes the database find the rows that
    # refer to it (to cascade, or to set NULL): without an index on the
    # column, one scan of the whole table per event. entity_versions had
    # none: a batch of 1,000 events beside 300,000 entity versions took
    # 17 s on PostgreSQL, locks held (0.05 s with the index).
    with app.app_context():
        inspector = sa_inspect(db.engine)
        for table in inspector.get_table_names():
            for fk in inspector.get_foreign_keys(table):
                if fk["referred_table"] != "events":
                    continue
                columns = fk["constrained_columns"]
                leading = [
                    index["column_names"][: len(columns)] for index in inspector.get_indexes(table)
                ] + [
                    unique["column_names"][: len(columns)]
                    for unique in inspector.get_unique_constraints(table)
                ]
                assert columns in leading, f"{table}.{columns} has no index"
