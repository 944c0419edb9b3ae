"""A target that stops answering holds its share of a worker's threads only until its circuit opens.

Real loopback HTTP servers and the worker's own loop (``Worker.run``). The
failing target never answers within its timeout; after its circuit's
``failures`` timeouts in a row the circuit opens, its other deliveries wait
out the cool-down unattempted, and the healthy target's deliveries have
every thread.
"""

from __future__ import annotations

import threading
import time

from webhook_receiver.extensions import db
from webhook_receiver.outbox import circuits

from ..servers import wait_until
from .conftest import FAST, config_with, delivery_rows, forward, store_event

FAILURES = 3


def _circuit(app) -> str:
    with app.app_context():
        state = circuits.read("shop", "down").state
        db.session.rollback()
        return state


def test_a_target_that_times_out_is_left_alone_once_its_circuit_opens(
    make_app, downstream, clock, make_worker
):
    config = config_with(
        [
            forward("healthy", downstream.url + "/healthy", event_types=["order.paid"]),
            forward(
                "down",
                downstream.url + "/down",
                event_types=["order.stuck"],
                timeout_seconds=0.3,
                circuit_breaker={"failures": FAILURES, "cool_down_seconds": 60},
            ),
        ]
    )
    app = make_app(config, **FAST, WORKER_THREADS=2)
    downstream.blocking.add("/down")  # holds every request past the forward's timeout
    downstream.delay = 0.005
    for n in range(20):
        store_event(app, clock, dedup_key=f"stuck-{n}", event_type="order.stuck")
    for n in range(40):
        store_event(app, clock, dedup_key=f"paid-{n}")
    worker = make_worker(app, clock)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    thread.start()
    try:
        assert wait_until(lambda: len(downstream.calls_to("/healthy")) == 40, timeout=60)
        assert wait_until(
            lambda: [r["state"] for r in delivery_rows(app)].count("delivered") == 40, timeout=20
        )
        assert wait_until(lambda: _circuit(app) == circuits.OPEN, timeout=20)
        time.sleep(1.0)  # time for more calls, were the circuit not holding them
    finally:
        worker.stop()
        thread.join(30)
    assert not thread.is_alive()
    # The circuit opened after FAILURES timeouts; the other 17 were never sent.
    assert len(downstream.calls_to("/down")) == FAILURES
    stuck = [r for r in delivery_rows(app) if r["consumer"] == "down"]
    assert sorted(r["attempts"] for r in stuck) == [0] * (20 - FAILURES) + [1] * FAILURES
    assert {r["state"] for r in stuck} == {"pending"}
