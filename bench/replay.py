"""A bulk replay's cost to the intake: ``python -m bench.replay``.

Stores ``--deliveries`` events (100,000 by default), each with one forward
delivery, marks them delivered, then runs an intake process that stores new
events one at a time (``inbox.receive``, each with its delivery, as a
webhook receipt does) for the whole case. Its rate is measured for
``--window`` seconds before the replay, during a replay of every delivered
delivery (in a process of its own, as ``flask --app wsgi deliveries replay
--yes`` runs it, started beforehand so that its imports are not counted),
and for ``--window`` seconds after. The row's
*during / around* is the rate during the replay over the mean of the rates
before and after. No worker runs: sending the replayed events is the
worker's cost, not the replay's.

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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .worker import RESULTS, ROOT, SECRET_KEY, databases, env_for

SOURCE = "bench-replay"


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


def replay_run(db_url: str, config_path: str, rest: str) -> None:
    """Replay every delivered delivery once told to (a line on stdin), as the CLI would."""
    from webhook_receiver import create_app
    from webhook_receiver.outbox.replays import Filter
    from webhook_receiver.processing import replay

    app = create_app(
        {"SECRET_KEY": SECRET_KEY, "SQLALCHEMY_DATABASE_URI": db_url, "CONFIG": config_path}
    )
    with app.app_context():
        print("ready", flush=True)
        sys.stdin.readline()
        plan = replay.preview(Filter(source=SOURCE, state="delivered"))
        replay.run(plan, actor="bench", via="cli", rest=float(rest) if rest else replay.REST)


def intake_loop(db_url: str, config_path: str) -> None:
    """Store new events one at a time until killed; print a count every 0.25 s (JSON lines)."""
    from webhook_receiver import create_app, inbox

    app = create_app(
        {"SECRET_KEY": SECRET_KEY, "SQLALCHEMY_DATABASE_URI": db_url, "CONFIG": config_path}
    )
    run = secrets.token_hex(4)
    n = 0
    tick = time.time() + 0.25
    with app.app_context():
        while True:
            outcome = inbox.receive(_message(f"intake-{run}-{n}"))
            assert isinstance(outcome, inbox.Accepted), outcome
            n += 1
            now = time.time()
            if now >= tick:
                print(json.dumps({"t": now, "n": n}), flush=True)
                tick = now + 0.25


@dataclass(frozen=True)
class Row:
    db: str
    deliveries: int
    replay_seconds: float
    before: float
    during: float
    after: float

    @property
    def ratio(self) -> float:
        return self.during / ((self.before + self.after) / 2)

    def cells(self) -> list[str]:
        return [
            self.db,
            f"{self.deliveries:,}",
            f"{self.replay_seconds:.1f}",
            f"{self.before:,.0f}",
            f"{self.during:,.0f}",
            f"{self.after:,.0f}",
            f"{self.ratio:.2f}",
        ]


def _rate(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """Events per second between two wall-clock times, from the intake's counts."""
    inside = [(t, n) for t, n in samples if start <= t <= end]
    if len(inside) < 2:
        raise RuntimeError(f"too few intake samples between {start} and {end}")
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return (n1 - n0) / (t1 - t0)


def run_case(
    app: Any,
    db_name: str,
    db_url: str,
    config_path: Path,
    n: int,
    window: float,
    logs: Path,
    rest: float | None,
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
    intake = subprocess.Popen(
        [sys.executable, "-m", "bench.replay", "--intake-loop", db_url, str(config_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(logs / f"replay-intake-{db_name}.log", "wb"),  # noqa: SIM115
        text=True,
    )
    samples: list[tuple[float, int]] = []

    def read_until(deadline: float) -> None:
        assert intake.stdout is not None
        while time.time() < deadline:
            line = intake.stdout.readline()
            if not line:
                raise RuntimeError(f"the intake loop ended; see {logs}")
            sample = json.loads(line)
            samples.append((sample["t"], sample["n"]))

    # The replay's process imports and connects first, then waits for its go.
    replayer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.replay",
            "--replay-run",
            db_url,
            str(config_path),
            "" if rest is None else str(rest),
        ],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(logs / f"replay-run-{db_name}.log", "wb"),  # noqa: SIM115
        text=True,
    )
    try:
        assert replayer.stdout is not None and replayer.stdin is not None
        if replayer.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the replay's process did not start; see {logs}")
        read_until(time.time() + 3.0)  # warm up
        before_start = time.time()
        read_until(before_start + window)
        replay_start = time.time()
        replayer.stdin.write("go\n")
        replayer.stdin.flush()
        while replayer.poll() is None:
            read_until(time.time() + 0.1)
        replay_end = time.time()
        if replayer.returncode != 0:
            raise RuntimeError(f"the replay failed ({replayer.returncode}); see {logs}")
        read_until(replay_end + window)
        after_end = time.time()
    finally:
        intake.kill()
        intake.wait()
        if replayer.poll() is None:
            replayer.kill()
            replayer.wait()
    with app.app_context():
        replayed = db.session.scalar(
            select(func.count()).select_from(Delivery).where(Delivery.replay_id.is_not(None))
        )
        db.session.rollback()
    if replayed != n:
        raise RuntimeError(f"{replayed} deliveries replayed, not {n}")
    return Row(
        db_name,
        n,
        replay_end - replay_start,
        _rate(samples, before_start, replay_start),
        _rate(samples, replay_start, replay_end),
        _rate(samples, replay_end, after_end),
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--intake-loop"]:
        intake_loop(argv[1], argv[2])
        return 0
    if argv[:1] == ["--replay-run"]:
        replay_run(argv[1], argv[2], argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=100_000)
    parser.add_argument("--window", type=float, default=10.0, help="seconds before and after")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--rest", type=float, default=None, help="the replay's --rest (its default if not given)"
    )
    parser.add_argument("--db", choices=["sqlite", "postgresql"])
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("BENCH_DATABASE_URL") or os.environ.get("TEST_DATABASE_URL"),
    )
    args = parser.parse_args(argv)

    from flask_migrate import upgrade

    from webhook_receiver import create_app
    from webhook_receiver.extensions import db

    rows: list[Row] = []
    logs = RESULTS / "replay-logs"
    logs.mkdir(parents=True, exist_ok=True)
    config_path = logs / "config.toml"
    config_path.write_text(config_toml())
    for _ in range(args.rounds):
        with databases(args.pg_url, args.db) as dbs:
            for db_name, db_url in dbs:
                app = create_app(
                    {
                        "SECRET_KEY": SECRET_KEY,
                        "SQLALCHEMY_DATABASE_URI": db_url,
                        "CONFIG": str(config_path),
                    }
                )
                with app.app_context():
                    upgrade()
                try:
                    row = run_case(
                        app,
                        db_name,
                        db_url,
                        config_path,
                        args.deliveries,
                        args.window,
                        logs,
                        args.rest,
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
        "replay s",
        "intake/s before",
        "during",
        "after",
        "during / around",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in sorted({r.db for r in rows}, reverse=True):
        mine = [r for r in rows if r.db == name]
        ratios = [r.ratio for r in mine]
        median = Row(
            name,
            args.deliveries,
            statistics.median(r.replay_seconds for r in mine),
            statistics.median(r.before for r in mine),
            statistics.median(r.during for r in mine),
            statistics.median(r.after for r in mine),
        )
        cells = median.cells()
        cells[-1] = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
