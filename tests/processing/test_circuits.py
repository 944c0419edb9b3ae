"""Circuit breakers: a target that keeps failing is left alone through a cool-down, then probed.

An in-process worker on the test's clock against a real loopback downstream,
on SQLite and PostgreSQL. The circuit lives in the database, so a second
worker (another process, as far as the circuit is concerned) sees it too;
the metric and the admin read it from there.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families

from webhook_receiver.config import ConfigError
from webhook_receiver.extensions import db
from webhook_receiver.outbox import circuits

from ..admin.conftest import PASSWORD, login
from .conftest import FAST, Reply, config_with, delivery_rows, drain, forward, store_event

LOGGER = "webhook_receiver.processing.limits"


def _app(make_app, downstream, **extra):
    config = config_with(
        [forward("billing", downstream.url + "/billing", max_attempts=50, **extra)]
    )
    return make_app(config, **FAST, ADMIN_PASSWORD=PASSWORD)


def _calls(downstream) -> int:
    return len(downstream.calls_to("/billing"))


def _circuit(app) -> circuits.Circuit:
    with app.app_context():
        found = circuits.read("shop", "billing")
        db.session.rollback()
        return found


def _metric(app) -> float | None:
    text = app.test_client().get("/metrics").get_data(as_text=True)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "webhook_receiver_circuit_open" and sample.labels == {
                "source": "shop",
                "consumer": "billing",
            }:
                return sample.value
    return None


def _admin_state(client) -> str:
    page = client.get("/admin/targets").get_data(as_text=True)
    row = page.split('data-target="shop/billing"', 1)[1].split("</tr>", 1)[0]
    return row.split('class="state state-', 1)[1].split('"', 1)[0]


def _attempts(app) -> int:
    return sum(r["attempts"] for r in delivery_rows(app))


def test_a_sink_answering_500_opens_the_circuit_and_a_probe_closes_it(
    make_app, downstream, clock, make_worker, caplog
):
    caplog.set_level(logging.INFO, logger=LOGGER)
    app = _app(make_app, downstream)
    admin = app.test_client()
    assert login(admin).status_code == 302
    downstream.replies["/billing"] = [Reply(500) for _ in range(100)]
    for n in range(3):
        store_event(app, clock, dedup_key=f"evt-{n}")
    worker = make_worker(app, clock)
    assert (_metric(app), _admin_state(admin)) == (0, "closed")

    # Five failures in a row open it, whichever deliveries they were.
    while _calls(downstream) < 5:
        drain(app, worker)
        clock.advance(1)
    opened = _circuit(app)
    assert opened.state == circuits.OPEN
    assert opened.failures == 5
    assert (_metric(app), _admin_state(admin)) == (1, "open")
    assert _attempts(app) == 5

    # No attempt during the cool-down: not by this worker, not by another
    # (which knows nothing of it but what the database says), not for a
    # new event.
    store_event(app, clock, dedup_key="evt-new")
    for _ in range(5):
        clock.advance(10)
        assert set(drain(app, worker)) <= {"held"}
        assert set(drain(app, make_worker(app, clock))) <= {"held"}
    assert _calls(downstream) == 5
    assert _attempts(app) == 5  # held back is not an attempt
    assert all(r["state"] == "pending" for r in delivery_rows(app))

    # The cool-down is over and the sink has recovered: one probe, held
    # open downstream while the test looks.
    downstream.replies["/billing"] = []
    downstream.blocking.add("/billing")
    clock.advance(11)
    downstream.arrived.clear()
    prober = threading.Thread(target=drain, args=(app, worker, 1_000))
    prober.start()
    assert downstream.arrived.wait(20)
    assert _circuit(app).state == circuits.HALF_OPEN
    assert (_metric(app), _admin_state(admin)) == (1, "half_open")
    # Another worker finds the probe in flight: it sends nothing.
    assert set(drain(app, make_worker(app, clock))) <= {"held"}
    assert _calls(downstream) == 6
    downstream.gate.set()
    prober.join(20)
    assert not prober.is_alive()

    closed = _circuit(app)
    assert (closed.state, closed.failures) == (circuits.CLOSED, 0)
    assert (_metric(app), _admin_state(admin)) == (0, "closed")
    clock.advance(2)  # past the short wait of what was held back during the probe
    drain(app, make_worker(app, clock))
    assert [r["state"] for r in delivery_rows(app)] == ["delivered"] * 4
    # 5 failures, then one call per delivery: the probe and the three others.
    assert _calls(downstream) == 9

    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert [line for line in lines if "opened" in line[1]] == [
        (
            "WARNING",
            f"circuit of billing (shop) opened after 5 failures in a row; no delivery until "
            f"{opened.retry_at.isoformat()}",
        )
    ]
    assert [line for line in lines if "closed" in line[1]] == [
        ("INFO", "circuit of billing (shop) closed: its probe was answered")
    ]


def test_a_failed_probe_opens_it_for_another_cool_down(
    make_app, downstream, clock, make_worker, caplog
):
    caplog.set_level(logging.INFO, logger=LOGGER)
    app = _app(make_app, downstream, circuit_breaker={"failures": 2, "cool_down_seconds": 30})
    downstream.replies["/billing"] = [Reply(503) for _ in range(100)]
    store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    while _calls(downstream) < 2:
        drain(app, worker)
        clock.advance(1)
    first = _circuit(app)
    assert first.state == circuits.OPEN

    clock.now = first.retry_at
    assert drain(app, worker) == ["retry"]  # the probe, failed
    again = _circuit(app)
    assert again.state == circuits.OPEN
    assert again.retry_at == clock() + (first.retry_at - first.opened_at)
    assert _calls(downstream) == 3
    clock.advance(29)
    assert set(drain(app, worker)) <= {"held"}
    assert _calls(downstream) == 3
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert sum("opened after" in m for m in messages) == 1
    assert sum("stays open: its probe failed" in m for m in messages) == 1


def test_any_answer_resets_the_failures_in_a_row(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream)
    downstream.replies["/billing"] = [Reply(500)] * 4 + [Reply(200)] + [Reply(500)] * 4
    for n in range(9):
        store_event(app, clock, dedup_key=f"evt-{n}")
    outcomes = drain(app, make_worker(app, clock))
    assert outcomes == ["retry"] * 4 + ["delivered"] + ["retry"] * 4
    found = _circuit(app)
    assert (found.state, found.failures) == (circuits.CLOSED, 4)


def test_a_refusal_is_an_answer_not_a_failure(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream)
    downstream.replies["/billing"] = [Reply(400) for _ in range(8)]
    for n in range(8):
        store_event(app, clock, dedup_key=f"evt-{n}")
    assert drain(app, make_worker(app, clock)) == ["dead"] * 8
    assert _circuit(app).state == circuits.CLOSED


def test_a_circuit_breaker_turned_off_never_opens(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream, circuit_breaker=False)
    downstream.replies["/billing"] = [Reply(500) for _ in range(100)]
    for n in range(10):
        store_event(app, clock, dedup_key=f"evt-{n}")
    assert drain(app, make_worker(app, clock)) == ["retry"] * 10
    assert _calls(downstream) == 10
    assert _circuit(app) == circuits.Circuit("shop", "billing")  # never written
    assert _metric(app) is None  # no circuit to show


def test_a_probe_whose_worker_died_is_taken_over(make_app, downstream, clock, make_worker):
    app = _app(make_app, downstream, circuit_breaker={"failures": 1, "cool_down_seconds": 10})
    downstream.replies["/billing"] = [Reply(500)]
    store_event(app, clock, dedup_key="evt-1")
    worker = make_worker(app, clock)
    assert drain(app, worker) == ["retry"]
    clock.advance(10)
    with app.app_context():
        # A worker took the probe, then died before it answered.
        until = clock() + timedelta(seconds=2)
        with db.session.begin():
            assert circuits.take_probe("shop", "billing", "dead-worker", clock(), until)
    # Its probe is in flight, as far as anyone can tell: nothing is sent.
    assert drain(app, make_worker(app, clock)) == ["held"]
    assert _calls(downstream) == 1
    clock.advance(2)  # the dead worker's probe has run out of time: another takes over
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    assert _calls(downstream) == 2
    assert _circuit(app).state == circuits.CLOSED


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"failures": 0}, "circuit_breaker.failures must be a positive integer"),
        ({"failures": True}, "circuit_breaker.failures must be a positive integer"),
        ({"cool_down_seconds": -1}, "cool_down_seconds must be a positive number"),
        ({"cooldown": 5}, "must be false or a table of failures and cool_down_seconds"),
        (True, "must be false or a table of failures and cool_down_seconds"),
    ],
)
def test_a_bad_circuit_breaker_is_refused_at_load(make_app, value, says):
    with pytest.raises(ConfigError, match=says):
        make_app(config_with([forward("billing", "http://127.0.0.1:9/b", circuit_breaker=value)]))


@pytest.mark.parametrize("value", [0, -5, True, "20", 100_001, 1e-12])
def test_a_bad_rate_limit_is_refused_at_load(make_app, value):
    with pytest.raises(
        ConfigError, match=r"max_per_second must be a number from 1e-05 .* to 100000"
    ):
        make_app(config_with([forward("billing", "http://127.0.0.1:9/b", max_per_second=value)]))
