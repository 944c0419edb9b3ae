"""The Idempotency-Key engine on views of its own: the state machine's scenarios.

Each scenario runs with the views in both modes: one commit (the claim in
the view's transaction, the default) and two phases (the claim committed
first, under a lease).
"""

from __future__ import annotations

import functools
import inspect
import json
from datetime import timedelta
from unittest.mock import patch

import pytest
from flask import Blueprint, abort, g, jsonify, make_response
from sqlalchemy import func, insert, select

from webhook_receiver import idempotency
from webhook_receiver.api.auth import require_client
from webhook_receiver.extensions import db
from webhook_receiver.idempotency.decorator import request_fingerprint, run_claimed
from webhook_receiver.idempotency.persistence import records
from webhook_receiver.idempotency.persistence.records import COMPLETED, IN_PROGRESS
from webhook_receiver.models import Event, IdempotencyRecord, utcnow
from webhook_receiver.problems import Problem

from ..conftest import bearer
from ..helpers import count, event_row, post_event

calls: list[str] = []


def _write_event(tag: str) -> int:
    return db.session.execute(
        insert(Event.__table__).values(event_row(event_type=tag)).returning(Event.__table__.c.id)
    ).scalar_one()


def make_test_blueprint(two_phase: bool = False) -> Blueprint:
    bp = Blueprint("engine_test", __name__)
    idempotent = functools.partial(idempotency.idempotent, two_phase=two_phase)

    @bp.post("/t/ok")
    @require_client
    @idempotent()
    def ok():
        calls.append("ok")
        event_id = _write_event("ok")
        response = make_response(jsonify(id=event_id, n=len(calls)), 201)
        response.headers["Location"] = f"/x/{event_id}"
        response.headers["Set-Cookie"] = "session=secret"
        response.headers["X-Custom"] = "kept"
        response.headers["Cache-Control"] = "no-store"
        return response

    @bp.post("/t/raise")
    @require_client
    @idempotent()
    def boom():
        calls.append("raise")
        _write_event("raise")
        raise RuntimeError("handler bug")

    @bp.post("/t/500")
    @require_client
    @idempotent()
    def five_hundred():
        calls.append("500")
        _write_event("500")
        return jsonify(error="downstream"), 503

    @bp.post("/t/problem")
    @require_client
    @idempotent()
    def problem():
        calls.append("problem")
        raise Problem("invalid-event", "nope")

    @bp.post("/t/write-then-problem")
    @require_client
    @idempotent()
    def write_then_problem():
        calls.append("write-then-problem")
        _write_event("partial")
        raise Problem("invalid-event", "refused after a write")

    @bp.post("/t/abort")
    @require_client
    @idempotent()
    def aborted():
        calls.append("abort")
        abort(404)

    @bp.post("/t/who")
    @require_client
    @idempotent()
    def who():
        calls.append(g.client)
        return jsonify(client=g.client)

    return bp


@pytest.fixture(params=["one_commit", "two_phase"])
def app(request, make_app):
    calls.clear()
    app = make_app(PROPAGATE_EXCEPTIONS=False)
    app.register_blueprint(make_test_blueprint(two_phase=request.param == "two_phase"))
    return app


def post(client, path, key="k1", body=None, **headers):
    return post_event(
        client, key, body if body is not None else {"a": 1}, headers=headers, path=path
    )


def record(app, key="k1", client="acme"):
    with app.app_context():
        return db.session.execute(
            select(IdempotencyRecord).where(
                IdempotencyRecord.client == client, IdempotencyRecord.key == key
            )
        ).scalar_one_or_none()


def test_first_request_executes_and_completes(app, client):
    response = post(client, "/t/ok")
    assert response.status_code == 201
    assert calls == ["ok"]
    rec = record(app)
    assert rec.state == COMPLETED
    assert rec.response_status == 201
    assert rec.lease_token is None
    assert rec.expires_at - rec.created_at == timedelta(hours=24)


def test_replay_is_exact_and_filters_unsafe_headers(app, client):
    first = post(client, "/t/ok")
    second = post(client, "/t/ok")
    assert calls == ["ok"]
    assert second.status_code == 201
    assert second.get_data() == first.get_data()
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.headers["Location"] == first.headers["Location"]
    assert second.headers["X-Custom"] == "kept"
    assert "Set-Cookie" not in second.headers
    assert "Cache-Control" not in second.headers
    assert count(app) == 1


def test_mismatch_is_422_without_executing(app, client):
    post(client, "/t/ok")
    response = post(client, "/t/ok", body={"a": 2})
    assert response.status_code == 422
    assert response.get_json()["type"] == "/problems/idempotency-key-reused"
    assert calls == ["ok"]


def claimed_elsewhere(app, key: str, lease_left: timedelta) -> None:
    """Store an in-progress claim of another request, its lease ending ``lease_left`` from now."""
    with app.app_context():
        now = utcnow()
        db.session.add(
            IdempotencyRecord(
                client="acme",
                key=key,
                fingerprint="f" * 64,
                method="POST",
                path="/t/ok",
                state=IN_PROGRESS,
                lease_token="another-holder",
                lease_expires_at=now + lease_left,
                created_at=now + lease_left - timedelta(seconds=60),
                expires_at=now + timedelta(hours=24),
            )
        )
        db.session.commit()


def test_in_flight_is_409_with_retry_after(app, client):
    claimed_elsewhere(app, "busy", timedelta(seconds=30))
    response = post(client, "/t/ok", key="busy")
    assert response.status_code == 409
    assert response.get_json()["type"] == "/problems/idempotency-key-in-use"
    assert 29 <= int(response.headers["Retry-After"]) <= 30
    assert calls == []


def test_expired_lease_of_a_crashed_holder_is_taken_over(app, client):
    claimed_elsewhere(app, "crashed", timedelta(seconds=-1))
    response = post(client, "/t/ok", key="crashed")
    assert response.status_code == 201
    assert calls == ["ok"]
    rec = record(app, "crashed")
    assert rec.state == COMPLETED and rec.lease_token is None
    assert post(client, "/t/ok", key="crashed").headers["Idempotent-Replayed"] == "true"


def test_exception_rolls_back_and_releases_the_key(app, client):
    response = post(client, "/t/raise")
    assert response.status_code == 500
    assert count(app) == 0
    assert record(app) is None
    again = post(client, "/t/raise")
    assert again.status_code == 500
    assert calls == ["raise", "raise"]


def test_5xx_rolls_back_and_releases_the_key(app, client):
    assert post(client, "/t/500").status_code == 503
    assert count(app) == 0
    assert record(app) is None
    post(client, "/t/500")
    assert calls == ["500", "500"]


def test_4xx_results_are_stored_and_replayed(app, client):
    first = post(client, "/t/problem")
    assert first.status_code == 400
    assert first.mimetype == "application/problem+json"
    second = post(client, "/t/problem")
    assert second.status_code == 400
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.mimetype == "application/problem+json"
    assert calls == ["problem"]
    assert post(client, "/t/abort", key="k2").status_code == 404
    assert post(client, "/t/abort", key="k2").headers["Idempotent-Replayed"] == "true"
    assert calls == ["problem", "abort"]


def test_expired_record_counts_as_absent(make_app):
    calls.clear()
    app = make_app(IDEMPOTENCY_TTL_SECONDS=1, IDEMPOTENCY_LEASE_SECONDS=1)
    app.register_blueprint(make_test_blueprint())
    client = app.test_client()
    post(client, "/t/ok")
    with app.app_context():
        rec = db.session.execute(select(IdempotencyRecord)).scalar_one()
        rec.expires_at = utcnow() - timedelta(seconds=1)
        db.session.commit()
    # even a different body: the old record no longer exists for the client
    response = post(client, "/t/ok", body={"a": 99})
    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response.headers
    assert calls == ["ok", "ok"]
    assert count(app) == 2


def test_purge_deletes_expired_records_in_batches(app, client, runner):
    with app.app_context():
        now = utcnow()
        for i in range(7):
            db.session.add(
                IdempotencyRecord(
                    client="acme",
                    key=f"old-{i}",
                    fingerprint="f" * 64,
                    method="POST",
                    path="/",
                    state=COMPLETED,
                    created_at=now - timedelta(days=2),
                    expires_at=now - timedelta(days=1),
                )
            )
        db.session.commit()
    post(client, "/t/ok", key="fresh")
    result = runner.invoke(args=["purge", "--batch-size", "3"])
    assert result.exit_code == 0, result.output
    assert "purged 7 expired idempotency record(s)" in result.output
    with app.app_context():
        keys = db.session.scalars(select(IdempotencyRecord.key)).all()
    assert keys == ["fresh"]


def test_same_key_two_clients_two_records(app, client):
    from ..conftest import GLOBEX_TOKEN

    a = post(client, "/t/who")
    b = client.post(
        "/t/who",
        data=json.dumps({"a": 1}),
        content_type="application/json",
        headers={**bearer(GLOBEX_TOKEN), "Idempotency-Key": "k1"},
    )
    assert a.get_json() == {"client": "acme"}
    assert b.get_json() == {"client": "globex"}
    assert calls == ["acme", "globex"]
    assert record(app, client="acme").id != record(app, client="globex").id


def test_a_view_that_writes_then_refuses_keeps_none_of_its_writes(app, client):
    first = post(client, "/t/write-then-problem")
    assert first.status_code == 400
    assert count(app) == 0
    again = post(client, "/t/write-then-problem")
    assert again.status_code == 400
    assert again.headers["Idempotent-Replayed"] == "true"
    assert calls == ["write-then-problem"]
    assert count(app) == 0


def test_same_key_and_body_on_another_path_is_a_mismatch(app, client):
    assert post(client, "/t/ok").status_code == 201
    # The path is part of the fingerprint: another view is another request.
    response = post(client, "/t/who")
    assert response.status_code == 422
    assert response.get_json()["type"] == "/problems/idempotency-key-reused"
    assert calls == ["ok"]
    assert count(app) == 1


def test_two_phase_holder_that_lost_its_lease_is_fenced(make_app):
    calls.clear()
    app = make_app(PROPAGATE_EXCEPTIONS=False)
    app.register_blueprint(make_test_blueprint(two_phase=True))
    lease, ttl = timedelta(seconds=60), timedelta(hours=24)
    req = records.Request("acme", "slow", request_print(app, "/t/ok"), "POST", "/t/ok")
    with app.app_context():
        start = utcnow()
        stale = records.claim(req, start, lease, ttl)
        assert isinstance(stale, records.Claimed)
        # Within the lease a retry is told to wait...
        assert isinstance(records.claim(req, start + lease / 2, lease, ttl), records.InFlight)
        # ...past it, the holder counts as crashed and the retry takes over.
        fresh = records.claim(req, start + lease + timedelta(seconds=1), lease, ttl)
        assert isinstance(fresh, records.Claimed)
        assert (fresh.record_id, fresh.token != stale.token) == (stale.record_id, True)

    # The stale holder was not dead after all: it runs and tries to complete.
    view = inspect.unwrap(app.view_functions["engine_test.ok"])  # the view itself
    with app.test_request_context("/t/ok", method="POST", json={"a": 1}):
        g.client = "acme"
        response = run_claimed(req, stale, view, (), {})
    assert response.status_code == 409
    assert response.get_json()["type"] == "/problems/idempotency-lease-lost"
    assert response.headers["Retry-After"] == "1"
    assert count(app) == 0  # its writes went with its answer
    rec = record(app, "slow")
    assert (rec.state, rec.lease_token, rec.response_status) == (IN_PROGRESS, fresh.token, None)

    # The new holder completes as if nothing happened.
    with app.test_request_context("/t/ok", method="POST", json={"a": 1}):
        g.client = "acme"
        assert run_claimed(req, fresh, view, (), {}).status_code == 201
    rec = record(app, "slow")
    assert (rec.state, rec.lease_token, rec.response_status) == (COMPLETED, None, 201)
    assert count(app) == 1
    assert post(app.test_client(), "/t/ok", key="slow").headers["Idempotent-Replayed"] == "true"


def request_print(app, path: str) -> str:
    """The fingerprint ``post`` gives a request to ``path``."""
    with app.test_request_context(path, method="POST", json={"a": 1}):
        return request_fingerprint()


# -- speculative: the view runs before the key is read, while retries are rare --


# What the flaky speculative view does on its runs after the first.
later_runs: dict[str, int | None] = {"answer": None}


@pytest.fixture
def speculative_app(make_app):
    calls.clear()
    later_runs["answer"] = None
    app = make_app(PROPAGATE_EXCEPTIONS=False)
    bp = Blueprint("speculative_test", __name__)

    @bp.post("/t/spec")
    @require_client
    @idempotency.idempotent(speculative=True)
    def spec():
        calls.append("spec")
        event_id = _write_event("spec")
        return jsonify(id=event_id), 201

    @bp.post("/t/spec-fails-after-the-first")
    @require_client
    @idempotency.idempotent(speculative=True)
    def fails_after_the_first():
        calls.append("flaky")
        event_id = _write_event("flaky")
        if len(calls) == 1:
            return jsonify(id=event_id), 201
        if later_runs["answer"] == 503:
            return jsonify(error="downstream"), 503
        raise RuntimeError("a bug that shows on a second run")

    app.register_blueprint(bp)
    return app


def test_a_speculative_view_runs_a_new_key_without_reading_it(speculative_app):
    client = speculative_app.test_client()
    with patch.object(records, "find", wraps=records.find) as find:
        response = post(client, "/t/spec", key="new")
    assert response.status_code == 201
    assert find.call_count == 0
    assert calls == ["spec"]
    assert (count(speculative_app), record(speculative_app, "new").state) == (1, COMPLETED)


def test_a_retry_of_a_speculative_view_rolls_its_run_back_and_replays(speculative_app):
    client = speculative_app.test_client()
    first = post(client, "/t/spec", key="k")
    with patch.object(records, "find", wraps=records.find) as find:
        retry = post(client, "/t/spec", key="k")
    # The view ran again (the key was not read first) and its event went
    # with the failed claim; the answer is the saved one, read afterwards.
    assert calls == ["spec", "spec"]
    assert find.call_count == 1
    assert count(speculative_app) == 1
    assert retry.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_data() == first.get_data()


def test_a_speculative_view_given_another_body_under_the_key_is_422(speculative_app):
    client = speculative_app.test_client()
    assert post(client, "/t/spec", key="k", body={"a": 1}).status_code == 201
    refused = post(client, "/t/spec", key="k", body={"a": 2})
    assert refused.status_code == 422
    assert refused.get_json()["type"] == "/problems/idempotency-key-reused"
    assert count(speculative_app) == 1


def test_a_speculative_view_reads_first_again_once_retries_are_common(speculative_app):
    client = speculative_app.test_client()
    assert post(client, "/t/spec", key="k").status_code == 201
    # Retries only: the share of taken keys climbs past a fifth within a
    # dozen of them (a moving average over about the last 30 requests).
    for _ in range(12):
        assert post(client, "/t/spec", key="k").headers["Idempotent-Replayed"] == "true"
    runs = len(calls)
    assert runs > 2  # the first retries ran the view
    for _ in range(5):
        assert post(client, "/t/spec", key="k").headers["Idempotent-Replayed"] == "true"
    assert len(calls) == runs  # now each retry is answered by its read alone
    assert count(speculative_app) == 1
    # New keys bring the share back down, and the view runs at once again.
    for i in range(60):
        assert post(client, "/t/spec", key=f"new-{i}").status_code == 201
    with patch.object(records, "find", wraps=records.find) as find:
        assert post(client, "/t/spec", key="last").status_code == 201
    assert find.call_count == 0


def test_a_two_phase_view_cannot_be_speculative():
    with pytest.raises(ValueError, match="cannot be speculative"):
        idempotency.idempotent(two_phase=True, speculative=True)


@pytest.mark.parametrize("failure", ["raises", "answers 503"])
def test_a_retry_whose_speculative_run_fails_gets_the_saved_answer(speculative_app, failure):
    client = speculative_app.test_client()
    path = "/t/spec-fails-after-the-first"
    first = post(client, path, key="k")
    assert first.status_code == 201
    later_runs["answer"] = 503 if failure == "answers 503" else None
    retry = post(client, path, key="k")
    # The view ran again and failed; nothing of it was kept, and the key's
    # saved answer is the retry's, as if the key had been read first.
    assert calls == ["flaky", "flaky"]
    assert retry.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_data() == first.get_data()
    assert count(speculative_app) == 1


def test_a_new_key_whose_speculative_run_fails_answers_the_failure(speculative_app):
    client = speculative_app.test_client()
    calls.append("the first run happened elsewhere")  # the view fails from now on
    response = post(client, "/t/spec-fails-after-the-first", key="fresh")
    assert response.status_code == 500
    assert record(speculative_app, "fresh") is None  # the key stays free for the retry
    assert count(speculative_app) == 0


@pytest.mark.parametrize("two_phase", [False, True])
def test_a_view_with_no_client_to_scope_its_keys_says_what_it_needs(make_app, two_phase):
    # Decorated alone, without require_client (or g.client set before it):
    # keys have no scope. The developer is told how to give one, rather than
    # an AttributeError from deep inside the engine; nothing is claimed.
    app = make_app()
    bp = Blueprint("unscoped", __name__)

    @bp.post("/unscoped")
    @idempotency.idempotent(two_phase=two_phase)
    def unscoped():
        return jsonify(ok=1), 201

    app.register_blueprint(bp)
    with pytest.raises(RuntimeError, match=r"g\.client.*require_client"):
        post(app.test_client(), "/unscoped", key="k-unscoped")
    with app.app_context():
        assert db.session.scalar(select(func.count()).select_from(IdempotencyRecord)) == 0
