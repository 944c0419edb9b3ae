"""A forward target that stalls holds its share of a worker's threads, not all of them.

Real loopback HTTP servers and the worker's own loop (``Worker.run``, its
threads and claims). The stalled target's first request is held open (until
the test lets it go, at most BLOCK_TIMEOUT seconds), as a target that stops
answering would, within a forward timeout long enough to wait for it.
"""

from __future__ import annotations

import threading
import time

import pytest

from ..servers import wait_until
from .conftest import FAST, config_with, delivery_rows, forward, store_event

# Measures rates: run alone (make test runs serial tests after the rest).
pytestmark = pytest.mark.serial

HEALTHY = 40
STALLED = 3
# Each healthy call takes this long downstream: the rate compared is then
# mostly the downstream's, steady on a loaded machine, plus the worker's
# own work per delivery.
HEALTHY_DELAY = 0.01


def _config(downstream, **healthy):
    return config_with(
        [
            forward("healthy", downstream.url + "/healthy", event_types=["order.paid"], **healthy),
            forward(
                "stalled",
                downstream.url + "/stalled",
                event_types=["order.stuck"],
                timeout_seconds=10,
            ),
        ]
    )


def _start(make_worker, app, clock):
    worker = make_worker(app, clock)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    thread.start()
    return worker, thread


def _stop(worker, thread) -> None:
    worker.stop()
    thread.join(20)
    assert not thread.is_alive()


def _healthy_calls(downstream) -> int:
    return len(downstream.calls_to("/healthy"))


def _seconds_for_healthy(downstream, make_worker, app, clock, until: int) -> tuple[float, object]:
    """Run a worker until the healthy target has ``until`` calls; the seconds it took."""
    worker, thread = _start(make_worker, app, clock)
    started = time.monotonic()
    reached = wait_until(lambda: _healthy_calls(downstream) >= until, timeout=30, interval=0.005)
    elapsed = time.monotonic() - started
    return (elapsed if reached else float("inf")), (worker, thread)


def test_a_stalled_target_leaves_the_others_at_least_80_percent_of_their_rate(
    make_app, downstream, clock, make_worker
):
    app = make_app(_config(downstream), **{**FAST, "WORKER_LEASE_SECONDS": 30}, WORKER_THREADS=2)
    downstream.delay = HEALTHY_DELAY
    downstream.blocking.add("/stalled")

    # The healthy target alone.
    for n in range(HEALTHY):
        store_event(app, clock, dedup_key=f"alone-{n}")
    alone, running = _seconds_for_healthy(downstream, make_worker, app, clock, HEALTHY)
    _stop(*running)

    # The same again, behind deliveries to a target that does not answer:
    # stored first, they are the most overdue and claimed first.
    for n in range(STALLED):
        store_event(app, clock, dedup_key=f"stuck-{n}", event_type="order.stuck")
    for n in range(HEALTHY):
        store_event(app, clock, dedup_key=f"beside-{n}")
    beside, running = _seconds_for_healthy(downstream, make_worker, app, clock, 2 * HEALTHY)
    # The stalled target holds one thread (its concurrency), one request.
    held = len(downstream.calls_to("/stalled"))
    downstream.gate.set()
    assert wait_until(
        lambda: all(r["state"] == "delivered" for r in delivery_rows(app)), timeout=20
    )
    _stop(*running)

    # The healthy target alone once more: the mean of both runs is its rate alone.
    for n in range(HEALTHY):
        store_event(app, clock, dedup_key=f"after-{n}")
    again, running = _seconds_for_healthy(downstream, make_worker, app, clock, 3 * HEALTHY)
    _stop(*running)

    rate_alone = 2 * HEALTHY / (alone + again)
    rate_beside = HEALTHY / beside
    report = (
        f"healthy alone {HEALTHY / alone:.1f}/s and {HEALTHY / again:.1f}/s, "
        f"beside a stalled target {rate_beside:.1f}/s"
    )
    print(report)
    assert held == 1, report
    assert rate_beside >= 0.8 * rate_alone, report
    assert len(downstream.calls_to("/stalled")) == STALLED


def test_a_forward_runs_as_many_deliveries_at_once_as_its_concurrency(
    make_app, downstream, clock, make_worker
):
    config = config_with(
        [forward("slow", downstream.url + "/slow", timeout_seconds=10, concurrency=2)]
    )
    app = make_app(config, **{**FAST, "WORKER_LEASE_SECONDS": 30}, WORKER_THREADS=4)
    downstream.blocking.add("/slow")
    for n in range(4):
        store_event(app, clock, dedup_key=f"evt-{n}")
    worker, thread = _start(make_worker, app, clock)
    try:
        assert wait_until(lambda: len(downstream.calls_to("/slow")) >= 2, timeout=20)
        time.sleep(0.3)  # two threads stay free, and claim nothing of this target
        assert len(downstream.calls_to("/slow")) == 2
        states = sorted(r["state"] for r in delivery_rows(app))
        assert states == ["in_progress", "in_progress", "pending", "pending"]
    finally:
        downstream.gate.set()
    assert wait_until(
        lambda: all(r["state"] == "delivered" for r in delivery_rows(app)), timeout=20
    )
    _stop(worker, thread)
    assert len(downstream.calls_to("/slow")) == 4
