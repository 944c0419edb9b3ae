"""A bulk replay's cost to the intake: ``python -m bench.replay``.

Stores ``--deliveries`` events (100,000 by default), each with one forward
delivery, and marks them delivered. Then two processes run side by side:

- the intake, storing new events one at a time (``inbox.receive``, each
  with its delivery, as a webhook receipt does) as fast as it can, and
  reporting its count every 0.1 s;
- the replay of every delivered delivery (``processing.replay``, as
  ``flask --app wsgi deliveries replay --yes`` runs it), in slices: it
  works for ``--slice`` seconds (its batches, each followed by its rest),
  then stands idle for as long, and so on to its end (a stop after a
  batch, and a claim of the replay again, as a worker resumes one).

The intake's rate in the slices the replay works is compared with its rate
in the idle slices beside them, so the machine's own drift (other
processes, a shared host's neighbours) falls on both alike. The first
0.2 s of each slice is left out (the change takes effect). No worker runs:
sending the replayed events is the worker's cost, not the replay's.

PostgreSQL is the server of ``BENCH_DATABASE_URL``, else ``TEST_DATABASE_URL``
(without either only SQLite runs); a fresh database is made there and dropped
at the end. It measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .worker import RESULTS, ROOT, SECRET_KEY, databases, env_for

SOURCE = "bench-replay"
SETTLE = 0.2  # seconds left out at the start of each slice


def config_toml() -> str:
    return "\n".join(
        [
            f"[sources.{SOURCE}]",
            'provider = "generic"',
            'secrets = ["bench-secret-0123456789"]',
            'signature_header = "X-Signature"',
            f"[[sources.{SOURCE}.forward]]",
            'name = "downstream"',
            'url = "http://127.0.0.1:9/hooks"',
            "",
        ]
    )


def _message(key: str) -> Any:
    from webhook_receiver import inbox

    return inbox.Message(
        source=SOURCE,
        dedup_key=key,
        fingerprint="0" * 64,
        body=json.dumps({"type": "bench.event", "data": {"key": key}}).encode(),
        event_type="bench.event",
        content_type="application/json",
    )


def _app(db_url: str, config_path: str) -> Any:
    from webhook_receiver import create_app

    return create_app(
        {"SECRET_KEY": SECRET_KEY, "SQLALCHEMY_DATABASE_URI": db_url, "CONFIG": config_path}
    )


def replay_run(db_url: str, config_path: str, rest: str, slice_seconds: str) -> None:
    """Replay every delivered delivery in working and idle slices; print each working slice."""
    from webhook_receiver.database import unit_of_work
    from webhook_receiver.models import utcnow
    from webhook_receiver.outbox import replays
    from webhook_receiver.outbox.replays import Filter
    from webhook_receiver.processing import replay

    app = _app(db_url, config_path)
    length = float(slice_seconds)
    with app.app_context():
        print("ready", flush=True)
        sys.stdin.readline()
        plan = replay.preview(Filter(source=SOURCE, state="delivered"))
        held: Any = replay.start(
            plan, actor="bench", via="cli", rest=float(rest) if rest else replay.REST
        )
        while True:
            stop = threading.Event()
            timer = threading.Timer(length, stop.set)
            started = time.time()
            timer.start()
            progress = replay.resume(held, stop=stop)
            timer.cancel()
            print(json.dumps({"start": started, "end": time.time()}), flush=True)
            if progress.finished:
                break
            time.sleep(length)
            with unit_of_work():
                held = replays.claim(utcnow(), replay.LEASE)
            assert held is not None


def intake_loop(db_url: str, config_path: str) -> None:
    """Store new events one at a time until killed; print a count every 0.1 s (JSON lines)."""
    from webhook_receiver import inbox

    app = _app(db_url, config_path)
    run = secrets.token_hex(4)
    n = 0
    tick = time.time() + 0.1
    with app.app_context():
        while True:
            outcome = inbox.receive(_message(f"intake-{run}-{n}"))
            assert isinstance(outcome, inbox.Accepted), outcome
            n += 1
            now = time.time()
            if now >= tick:
                print(json.dumps({"t": now, "n": n}), flush=True)
                tick = now + 0.1


@dataclass(frozen=True)
class Row:
    db: str
    deliveries: int
    working_seconds: float
    idle_rate: float
    working_rate: float

    @property
    def ratio(self) -> float:
        return self.working_rate / self.idle_rate

    def cells(self) -> list[str]:
        return [
            self.db,
            f"{self.deliveries:,}",
            f"{self.working_seconds:.1f}",
            f"{self.idle_rate:,.0f}",
            f"{self.working_rate:,.0f}",
            f"{self.ratio:.2f}",
        ]


def _events_and_seconds(
    samples: list[tuple[float, int]], slices: list[tuple[float, float]]
) -> tuple[int, float]:
    """The intake's events and seconds within the slices (less each one's first SETTLE s)."""
    events, seconds = 0, 0.0
    for start, end in slices:
        inside = [(t, n) for t, n in samples if start + SETTLE <= t <= end]
        if len(inside) >= 2:
            events += inside[-1][1] - inside[0][1]
            seconds += inside[-1][0] - inside[0][0]
    return events, seconds


def run_case(
    app: Any,
    db_name: str,
    db_url: str,
    config_path: Path,
    n: int,
    logs: Path,
    rest: float | None,
    slice_seconds: float,
) -> Row:
    from sqlalchemy import func, select, update

    from webhook_receiver import inbox
    from webhook_receiver.extensions import db
    from webhook_receiver.models import Delivery

    with app.app_context():
        run = secrets.token_hex(4)
        for start in range(0, n, 1000):
            inbox.receive_many(
                [_message(f"stored-{run}-{i}") for i in range(start, min(n, start + 1000))]
            )
        db.session.execute(update(Delivery).values(state="delivered", attempts=1))
        db.session.commit()
    env = env_for(db_url, config_path)

    def start(mode: str, *args: str, stdin: Any = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "bench.replay", mode, db_url, str(config_path), *args],
            cwd=ROOT,
            env=env,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=open(logs / f"replay{mode}-{db_name}.log", "wb"),  # noqa: SIM115
            text=True,
        )

    # The replay's process imports and connects first, then waits for its go.
    replayer = start(
        "--replay-run", "" if rest is None else str(rest), str(slice_seconds), stdin=subprocess.PIPE
    )
    intake = start("--intake-loop")
    samples: list[tuple[float, int]] = []

    def read_intake() -> None:
        assert intake.stdout is not None
        for line in intake.stdout:
            sample = json.loads(line)
            samples.append((sample["t"], sample["n"]))

    reader = threading.Thread(target=read_intake, daemon=True)
    reader.start()
    working: list[tuple[float, float]] = []
    try:
        assert replayer.stdout is not None and replayer.stdin is not None
        if replayer.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the replay's process did not start; see {logs}")
        time.sleep(3.0)  # the intake warms up
        replayer.stdin.write("go\n")
        replayer.stdin.flush()
        for line in replayer.stdout:
            piece = json.loads(line)
            working.append((piece["start"], piece["end"]))
        if replayer.wait() != 0:
            raise RuntimeError(f"the replay failed ({replayer.returncode}); see {logs}")
        time.sleep(slice_seconds)  # one more idle slice after the last working one
        ended = time.time()
    finally:
        intake.kill()
        intake.wait()
        if replayer.poll() is None:
            replayer.kill()
            replayer.wait()
        reader.join(5)
    with app.app_context():
        replayed = db.session.scalar(
            select(func.count()).select_from(Delivery).where(Delivery.replay_id.is_not(None))
        )
        db.session.rollback()
    if replayed != n:
        raise RuntimeError(f"{replayed} deliveries replayed, not {n}")
    # The idle slices: before the first working one, between them, after the last.
    edges = [working[0][0] - slice_seconds, *(t for piece in working for t in piece), ended]
    idle = list(zip(edges[0::2], edges[1::2], strict=True))
    (samples_path := logs / f"replay-samples-{db_name}.json").write_text(
        json.dumps({"samples": samples, "working": working})
    )
    work_events, work_seconds = _events_and_seconds(samples, working)
    idle_events, idle_seconds = _events_and_seconds(samples, idle)
    if not work_seconds or not idle_seconds:
        raise RuntimeError(f"too few intake samples; see {samples_path}")
    return Row(
        db_name,
        n,
        sum(end - start for start, end in working),
        idle_events / idle_seconds,
        work_events / work_seconds,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--intake-loop"]:
        intake_loop(argv[1], argv[2])
        return 0
    if argv[:1] == ["--replay-run"]:
        replay_run(argv[1], argv[2], argv[3], argv[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=100_000)
    parser.add_argument("--slice", type=float, default=2.0, help="seconds working, then idle")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--rest", type=float, default=None, help="the replay's rest (its default if not given)"
    )
    parser.add_argument("--db", choices=["sqlite", "postgresql"])
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("BENCH_DATABASE_URL") or os.environ.get("TEST_DATABASE_URL"),
    )
    args = parser.parse_args(argv)

    from flask_migrate import upgrade

    from webhook_receiver.extensions import db

    rows: list[Row] = []
    logs = RESULTS / "replay-logs"
    logs.mkdir(parents=True, exist_ok=True)
    config_path = logs / "config.toml"
    config_path.write_text(config_toml())
    for _ in range(args.rounds):
        with databases(args.pg_url, args.db) as dbs:
            for db_name, db_url in dbs:
                app = _app(db_url, str(config_path))
                with app.app_context():
                    upgrade()
                try:
                    row = run_case(
                        app,
                        db_name,
                        db_url,
                        config_path,
                        args.deliveries,
                        logs,
                        args.rest,
                        args.slice,
                    )
                finally:
                    with app.app_context():
                        db.session.remove()
                        db.engine.dispose()
                rows.append(row)
                print("  ".join(row.cells()), file=sys.stderr, flush=True)
    header = [
        "database",
        "deliveries",
        "replay working s",
        "intake/s, replay idle",
        "intake/s, replay working",
        "working / idle",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in sorted({r.db for r in rows}, reverse=True):
        mine = [r for r in rows if r.db == name]
        ratios = [r.ratio for r in mine]
        cells = Row(
            name,
            args.deliveries,
            statistics.median(r.working_seconds for r in mine),
            statistics.median(r.idle_rate for r in mine),
            statistics.median(r.working_rate for r in mine),
        ).cells()
        cells[-1] = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
