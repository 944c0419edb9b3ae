"""Worker throughput: ``python -m bench.worker``.

Deliveries per second to a loopback downstream (HTTP forwards) and handler
executions per second, on SQLite and PostgreSQL, with 1 and 2 worker
processes (``flask --app wsgi worker``). Forwards run three ways in the same
run: as configured by default (the circuit breaker on: its read before each
call), with ``circuit_breaker = false`` (no read: the worker as it was
before circuit breakers), and with a ``max_per_second`` too high to hold
anything back (the rate limit's slot, one UPDATE per call). Two more show
the attempt log's cost: the default forward with ``WORKER_ATTEMPT_LOG=false``
(no attempt rows), and as the worker was before this round of features
(neither circuit breaker nor attempt log). Each case stores ``--deliveries``
events in one transaction while the workers already wait, then times until
every delivery is delivered; every case is bounded by ``--timeout``.
``--rounds`` repeats the cases, in the opposite order every other round,
and gives each row's median and the ratios of the forwards' ways within
each round.

PostgreSQL is the server of ``BENCH_DATABASE_URL``, else ``TEST_DATABASE_URL``
(without either only SQLite runs); a fresh database is made there and dropped
at the end. SQLite's file lives under ``bench/results/``, not ``/tmp``, which
is often tmpfs, where fsync is free. It measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from webhook_receiver.processing import handler

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RESULTS = Path(__file__).resolve().parent / "results"
SECRET_KEY = "bench-secret-key-0123456789abcdef"
FORWARD_SOURCE = "bench-forward"
HANDLER_SOURCE = "bench-handler"
# Each case's source: its forward (or handler) is all that differs.
KINDS = {
    "forward, as before": "bench-forward-plain",
    "forward, no attempt log": FORWARD_SOURCE,
    "forward, no circuit breaker": "bench-forward-plain",
    "forward": FORWARD_SOURCE,
    "forward, max_per_second": "bench-forward-limited",
    "handler": HANDLER_SOURCE,
}
# The workers' settings a kind changes (the others run as configured).
NO_ATTEMPT_LOG = {"WEBHOOK_RECEIVER_WORKER_ATTEMPT_LOG": "false"}
KIND_ENV = {"forward, as before": NO_ATTEMPT_LOG, "forward, no attempt log": NO_ATTEMPT_LOG}
# Within each round: each kind's rate over another's, as "a / b".
RATIOS = [("forward", "forward, no attempt log"), ("forward", "forward, as before")]
# The forwards' settings besides their URL, by source.
FORWARD_SETTINGS = {
    "bench-forward-plain": ["circuit_breaker = false"],
    FORWARD_SOURCE: [],
    "bench-forward-limited": ["max_per_second = 100000"],
}


@handler(source=HANDLER_SOURCE, name="bench-noop")
def bench_noop(event: Any, session: Any) -> None:
    """A handler that reads its event and writes nothing: the framework's own cost."""
    assert event.body


@dataclass(frozen=True)
class Row:
    db: str
    kind: str
    workers: int
    deliveries: int
    seconds: float | None
    round: int = 0

    @property
    def rate(self) -> float | None:
        return self.deliveries / self.seconds if self.seconds else None

    def cells(self) -> list[str]:
        rate = f"{self.deliveries / self.seconds:,.0f}" if self.seconds else "timed out"
        took = f"{self.seconds:.2f}" if self.seconds else "-"
        return [self.db, self.kind, str(self.workers), str(self.deliveries), took, rate]


class _Downstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    wbufsize = 1 << 16

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def downstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Downstream)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hooks"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def config_toml(url: str) -> str:
    forwards = []
    for source, settings in FORWARD_SETTINGS.items():
        forwards += [
            f"[sources.{source}]",
            'provider = "generic"',
            'secrets = ["bench-secret-0123456789"]',
            'signature_header = "X-Signature"',
            f"[[sources.{source}.forward]]",
            'name = "downstream"',
            f"url = {json.dumps(url)}",
            "timeout_seconds = 5",
            *settings,
        ]
    return "\n".join(
        [
            'handlers = ["bench.worker"]',
            *forwards,
            f"[sources.{HANDLER_SOURCE}]",
            'provider = "generic"',
            'secrets = ["bench-secret-0123456789"]',
            'signature_header = "X-Signature"',
            "",
        ]
    )


def env_for(db_url: str, config_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "WEBHOOK_"))}
    env.update(
        DATABASE_URL=db_url,
        SECRET_KEY=SECRET_KEY,
        WEBHOOK_RECEIVER_CONFIG=str(config_path),
        WEBHOOK_RECEIVER_WORKER_POLL_SECONDS="0.05",
        WEBHOOK_RECEIVER_LOG_LEVEL="WARNING",
        PYTHONPATH=str(ROOT),
    )
    return env


@contextmanager
def databases(pg_url: str | None, only: str | None) -> Iterator[list[tuple[str, str]]]:
    """Fresh, empty databases: SQLite always, PostgreSQL when a server is given."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    RESULTS.mkdir(exist_ok=True)
    stamp = f"{datetime.now(UTC):%Y%m%d%H%M%S}_{secrets.token_hex(3)}"
    found: list[tuple[str, str]] = []
    sqlite_path = RESULTS / f"worker-{stamp}.sqlite3"
    if only in (None, "sqlite"):
        found.append(("sqlite", f"sqlite:///{sqlite_path}"))
    admin = None
    pg_name = f"wr_bench_worker_{stamp}"
    if pg_url and only in (None, "postgresql"):
        sa_url = pg_url.replace("postgres://", "postgresql://", 1).replace(
            "postgresql://", "postgresql+psycopg://", 1
        )
        admin = create_engine(sa_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{pg_name}"'))
        found.append(("postgresql", make_url(sa_url).set(database=pg_name).render_as_string(False)))
    try:
        yield found
    finally:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{sqlite_path}{suffix}").unlink(missing_ok=True)
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{pg_name}" WITH (FORCE)'))
            admin.dispose()


def start_workers(count: int, env: dict[str, str], logs: Path) -> list[subprocess.Popen[bytes]]:
    procs = []
    for n in range(count):
        with open(logs / f"worker-{n}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [str(BIN / "flask"), "--app", "wsgi", "worker"],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return procs


def stop_workers(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def run_case(
    app: Any, env: dict[str, str], kind: str, workers: int, n: int, timeout: float, logs: Path
) -> float | None:
    """Time ``n`` deliveries of one kind through ``workers`` processes; None on timeout."""
    from sqlalchemy import func, select

    from webhook_receiver import inbox
    from webhook_receiver.extensions import db
    from webhook_receiver.models import Delivery

    source = KINDS[kind]
    procs = start_workers(workers, env, logs)
    try:
        # Let the workers import and connect before the clock starts.
        time.sleep(2.0)
        with app.app_context():
            db.session.execute(Delivery.__table__.delete())
            db.session.commit()
            now = datetime.now(UTC)
            run = secrets.token_hex(4)
            inbox.receive_many(
                [
                    inbox.Message(
                        source=source,
                        dedup_key=f"{run}-{i}",
                        fingerprint="0" * 64,
                        body=json.dumps({"type": "bench.event", "data": {"i": i}}).encode(),
                        event_type="bench.event",
                        content_type="application/json",
                        received_at=now,
                    )
                    for i in range(n)
                ]
            )
            started = time.monotonic()
            deadline = started + timeout
            query = select(func.count()).select_from(Delivery).where(Delivery.state == "delivered")
            while time.monotonic() < deadline:
                done = db.session.scalar(query)
                db.session.rollback()
                if done >= n:
                    return time.monotonic() - started
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"a worker exited early; see {logs}")
                time.sleep(0.02)
            return None
    finally:
        stop_workers(procs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--kind", action="append", choices=list(KINDS), help="only these kinds (repeatable)"
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
    logs = RESULTS / "worker-logs"
    logs.mkdir(parents=True, exist_ok=True)
    with downstream() as url, databases(args.pg_url, args.db) as dbs:
        config_path = logs / "config.toml"
        config_path.write_text(config_toml(url))
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
                # Each worker count's kinds one after the other: the forwards'
                # ways are compared within minutes of each other.
                for workers in (1, 2):
                    for round_ in range(args.rounds):
                        kinds = [k for k in KINDS if not args.kind or k in args.kind]
                        for kind in kinds[:: -1 if round_ % 2 else 1]:
                            seconds = run_case(
                                app,
                                {**env_for(db_url, config_path), **KIND_ENV.get(kind, {})},
                                kind,
                                workers,
                                args.deliveries,
                                args.timeout,
                                logs,
                            )
                            row = Row(db_name, kind, workers, args.deliveries, seconds, round_)
                            rows.append(row)
                            print("  ".join(row.cells()), file=sys.stderr, flush=True)
            finally:
                with app.app_context():
                    db.session.remove()
                    db.engine.dispose()
    print_tables(rows, args.rounds)
    return 0 if all(r.seconds for r in rows) else 1


def print_tables(rows: list[Row], rounds: int) -> None:
    """Each case's row (its median over the rounds), then the forwards' ratios per round."""
    header = ["database", "consumer", "workers", "deliveries", "seconds", "per second"]
    if rounds > 1:
        header[-1] = f"per second (median of {rounds}, range)"
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    cases = list(dict.fromkeys((r.db, r.kind, r.workers) for r in rows))
    for case in cases:
        runs = [r for r in rows if (r.db, r.kind, r.workers) == case]
        rates = [r.rate for r in runs if r.rate]
        cells = runs[0].cells()
        if rounds > 1 and rates:
            took = statistics.median(r.seconds for r in runs if r.seconds)
            cells[-2] = f"{took:.2f}"
            cells[-1] = f"{statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f})"
        print("| " + " | ".join(cells) + " |")
    ratios = []
    for top, bottom in RATIOS:
        for db_name, workers in dict.fromkeys((r.db, r.workers) for r in rows):
            found = []
            for round_ in range(rounds):
                pair = {
                    r.kind: r.rate
                    for r in rows
                    if (r.db, r.workers, r.round) == (db_name, workers, round_)
                }
                if pair.get(top) and pair.get(bottom):
                    found.append(pair[top] / pair[bottom])
            if found:
                spread = f" ({min(found):.2f}-{max(found):.2f})" if len(found) > 1 else ""
                ratios.append(
                    f"| {db_name} | {workers} | {top} / {bottom} | "
                    f"{statistics.median(found):.2f}{spread} |"
                )
    if ratios:
        print()
        print("| database | workers | ratio | median over the rounds |")
        print("|---|---|---|---|")
        print("\n".join(ratios))


if __name__ == "__main__":
    raise SystemExit(main())
