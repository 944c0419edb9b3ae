"""Real worker processes (``flask --app wsgi worker``) against the test database.

A worker killed mid-call, several workers racing for one queue, SIGTERM.
Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from webhook_receiver import inbox
from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery

from ..servers import BIN, ROOT, app_env, wait_until
from .conftest import Clock, config_with, delivery, delivery_rows, forward, store_event

pytestmark = pytest.mark.slow


def to_toml(config: dict[str, Any]) -> str:
    """Write the small receiver configs of these tests as TOML."""
    lines = []
    if "handlers" in config:
        lines.append(f"handlers = {json.dumps(config['handlers'])}")
    for kind in ("clients", "sources"):
        for name, table in config.get(kind, {}).items():
            lines.append(f"[{kind}.{name}]")
            for key, value in table.items():
                if key != "forward":
                    lines.append(f"{key} = {json.dumps(value)}")
            for fwd in table.get("forward", []):
                lines.append(f"[[{kind}.{name}.forward]]")
                lines.extend(f"{key} = {json.dumps(value)}" for key, value in fwd.items())
    return "\n".join(lines) + "\n"


class WorkerProcess:
    def __init__(self, process: subprocess.Popen[bytes], log_path: Path) -> None:
        self.process = process
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def processed(self) -> int:
        match = re.search(r"worker processed (\d+) deliveries", self.log())
        assert match, self.log()
        return int(match.group(1))


@pytest.fixture
def workers(db_url: str, tmp_path: Path) -> Iterator[Any]:
    """Start worker processes on this test's database; all are killed at the end."""
    started: list[WorkerProcess] = []

    def start(config: dict[str, Any], **settings: Any) -> WorkerProcess:
        config_path = tmp_path / f"config-{len(started)}.toml"
        config_path.write_text(to_toml(config))
        extra = {"WEBHOOK_RECEIVER_WORKER_POLL_SECONDS": "0.05"}
        extra.update({f"WEBHOOK_RECEIVER_WORKER_{k.upper()}": str(v) for k, v in settings.items()})
        log_path = tmp_path / f"worker-{len(started)}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [str(BIN / "flask"), "--app", "wsgi", "worker"],
                cwd=ROOT,
                env=app_env(db_url, config_path, extra),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = WorkerProcess(process, log_path)
        started.append(worker)
        return worker

    def ready(worker: WorkerProcess) -> None:
        ok = wait_until(lambda: "started" in worker.log() or worker.process.poll() is not None)
        assert ok and worker.process.poll() is None, worker.log()

    start.ready = ready  # type: ignore[attr-defined]
    yield start
    for worker in started:
        if worker.process.poll() is None:
            os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.wait(10)


def _stop(worker: WorkerProcess, timeout: float = 15) -> int:
    os.killpg(worker.process.pid, signal.SIGTERM)
    return worker.process.wait(timeout)


def test_worker_killed_mid_call_is_finished_by_another_with_the_same_key(
    make_app, downstream, workers
):
    config = config_with([forward("billing", downstream.url + "/billing", timeout_seconds=0.5)])
    app = make_app(config)
    event_id = store_event(app, Clock(), dedup_key="evt-1")
    downstream.blocking.add("/billing")

    first = workers(config, lease_seconds=2)
    assert downstream.arrived.wait(20), first.log()
    # The downstream has applied the event; the worker dies before it hears so.
    os.killpg(first.process.pid, signal.SIGKILL)
    first.process.wait(10)
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"]) == ("in_progress", 1)

    second = workers(config, lease_seconds=2)
    assert wait_until(
        lambda: delivery(app, event_id, "billing")["state"] == "delivered", timeout=20
    ), second.log()
    assert _stop(second) == 0
    calls = downstream.calls_to("/billing")
    assert [c.headers["Idempotency-Key"] for c in calls] == ["billing:shop:evt-1"] * 2
    assert downstream.applied == ["billing:shop:evt-1"]
    row = delivery(app, event_id, "billing")
    assert (row["state"], row["attempts"], row["response_status"]) == ("delivered", 2, 200)


@pytest.mark.parametrize("count", [2, 4])
def test_concurrent_workers_never_claim_one_delivery_twice(make_app, downstream, workers, count):
    config = config_with(
        [
            forward("billing", downstream.url + "/billing"),
            forward("crm", downstream.url + "/crm"),
        ]
    )
    app = make_app(config)
    downstream.delay = 0.002
    procs = [workers(config) for _ in range(count)]
    for proc in procs:
        workers.ready(proc)
    clock = Clock()
    with app.app_context():
        inbox.receive_many(
            [
                inbox.Message(
                    source="shop",
                    dedup_key=f"evt-{n}",
                    fingerprint="f" * 64,
                    body=json.dumps({"n": n}).encode(),
                    event_type="order.paid",
                    content_type="application/json",
                    received_at=clock(),
                )
                for n in range(100)
            ]
        )

    def delivered() -> int:
        with app.app_context():
            n = db.session.scalar(
                select(func.count()).select_from(Delivery).where(Delivery.state == "delivered")
            )
            db.session.rollback()
            return n

    assert wait_until(lambda: delivered() == 200, timeout=60, interval=0.2), [
        p.log() for p in procs
    ]
    assert [_stop(p) for p in procs] == [0] * count
    keys = Counter(c.headers["Idempotency-Key"] for c in downstream.calls)
    expected = {f"{c}:shop:evt-{n}" for c in ("billing", "crm") for n in range(100)}
    assert set(keys) == expected
    assert set(keys.values()) == {1}
    assert sorted(downstream.applied) == sorted(expected)
    assert {r["attempts"] for r in delivery_rows(app)} == {1}
    processed = [p.processed() for p in procs]
    assert sum(processed) == 200
    assert sum(1 for n in processed if n) >= 2, processed


def test_sigterm_lets_the_current_delivery_finish(make_app, downstream, workers):
    config = config_with([forward("billing", downstream.url + "/billing")])
    app = make_app(config)
    clock = Clock()
    first = store_event(app, clock, dedup_key="evt-1")
    second = store_event(app, clock, dedup_key="evt-2")
    downstream.blocking.add("/billing")
    worker = workers(config)
    assert downstream.arrived.wait(20), worker.log()
    os.killpg(worker.process.pid, signal.SIGTERM)
    time.sleep(0.3)
    assert worker.process.poll() is None, worker.log()  # still finishing
    downstream.gate.set()
    assert worker.process.wait(15) == 0, worker.log()
    assert worker.processed() == 1
    assert delivery(app, first, "billing")["state"] == "delivered"
    row = delivery(app, second, "billing")
    assert (row["state"], row["attempts"]) == ("pending", 0)


def test_worker_refuses_a_lease_shorter_than_a_forward_can_take(make_app, downstream, workers):
    config = config_with([forward("billing", downstream.url + "/b", timeout_seconds=10)])
    worker = workers(config, lease_seconds=15)
    assert worker.process.wait(20) != 0
    assert "WORKER_LEASE_SECONDS (15) must exceed twice" in worker.log()


def test_worker_command_drains_the_queue(make_app, downstream):
    config = config_with([forward("billing", downstream.url + "/billing")])
    app = make_app(config, WORKER_POLL_SECONDS=0.05)
    event_id = store_event(app, Clock(), dedup_key="evt-1")
    result = app.test_cli_runner().invoke(args=["worker", "--drain"])
    assert result.exit_code == 0, result.output
    assert "worker processed 1 deliveries" in result.output
    assert delivery(app, event_id, "billing")["state"] == "delivered"
