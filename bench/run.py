"""The benchmark harness: fresh databases, gunicorn, wrk, and the results table.

Each scenario of ``bench.scenarios.SCENARIOS`` runs on each database: a
gunicorn with the same options serves the scenario's app, the scenario
prepares its requests against the live server, and wrk loads it for a fixed
time after a short warm-up. Nothing here knows what a scenario sends.

A machine shared with others (a cloud VM whose CPU is stolen by its
neighbours) moves throughput by a third from one minute to the next. So a
scenario's load is cut into slices interleaved with slices of the
baseline's (both servers up, one loaded at a time), the scenarios run in
rounds, and a scenario's ratio is the median of its rounds' ratios. The CPU time
the server spent per request (gunicorn's workers plus a PostgreSQL on this
machine) is reported too: stolen time does not count in it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import requests

from .front import nginx
from .scenarios import RUN_ID, SCENARIOS, Context, Load

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LUA = Path(__file__).resolve().parent / "lua"
RESULTS = Path(__file__).resolve().parent / "results"

WRK_MISSING = (
    "wrk is not installed. On Debian or Ubuntu: sudo apt-get install -y wrk "
    "(then run `make bench` again)."
)


@dataclass(frozen=True)
class Options:
    duration: float
    warmup: float
    workers: int
    connections: int
    threads: int
    front: str = ""  # "nginx": load through deploy/nginx in front of gunicorn
    rounds: int = 3
    slices: int = 4  # each scenario's load, interleaved with the baseline's in this many parts


@dataclass(frozen=True)
class Result:
    scenario: str
    db: str
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_seconds: float = 0.0  # the server's CPU time over the measured run
    round: int = 1
    # The scenario whose slices were interleaved with the baseline's: a row
    # and the baseline run it is compared with share it.
    against: str = ""

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.cpu_seconds / self.requests if self.requests else 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


# -- databases -----------------------------------------------------------------


@contextmanager
def sqlite_database(workdir: Path) -> Iterator[str]:
    """A fresh SQLite file on disk (not tmpfs: commits must really reach the disk)."""
    yield f"sqlite:///{workdir / 'bench.sqlite3'}"


@contextmanager
def postgresql_database(server_url: str) -> Iterator[str]:
    """A fresh database on the given server, dropped afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from webhook_receiver.config import database_uri

    base = database_uri(server_url, "/nonexistent")
    name = f"wr_bench_{datetime.now(UTC):%Y%m%d%H%M%S}_{secrets.token_hex(3)}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def app_env(db_url: str, config_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an app process on ``db_url`` with this config file."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLASK_", "WEBHOOK_RECEIVER_"))
        and k not in ("DATABASE_URL", "PROMETHEUS_MULTIPROC_DIR")
    }
    env.update(
        DATABASE_URL=db_url,
        BENCH_DATABASE_URL=db_url,
        SECRET_KEY=secrets.token_hex(32),
        WEBHOOK_RECEIVER_CONFIG=str(config_path),
        PYTHONPATH=str(ROOT),
    )
    env.update(extra or {})
    return env


def migrate(env: dict[str, str]) -> None:
    """Run the real migrations, as the Procfile's release step does."""
    subprocess.run(
        [str(BIN / "flask"), "--app", "wsgi", "db", "upgrade"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )


# -- gunicorn and wrk --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_cpu(pid: int, *, children: bool = False) -> float:
    """User plus system CPU seconds of one process (0 if it is gone), and its ended children's."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime: children waited for
    return ticks / _TICKS


def server_cpu(master_pid: int) -> float:
    """CPU seconds so far of gunicorn's workers and of any PostgreSQL on this machine.

    Linux only (``/proc``); elsewhere 0. PostgreSQL's processes are found by
    name, so a database on another host is not counted.
    """
    try:
        children = Path(f"/proc/{master_pid}/task/{master_pid}/children").read_text().split()
    except OSError:
        return 0.0
    return sum(_process_cpu(int(pid)) for pid in children) + processes_cpu("postgres")


def processes_cpu(name: str) -> float:
    """CPU seconds so far of every process on this machine named ``name`` (0 off Linux).

    With their ended children's (a PostgreSQL backend or autovacuum worker
    that exited is counted in the postmaster's).
    """
    total = 0.0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == name:
                    total += _process_cpu(int(entry.name), children=True)
            except OSError:
                pass
    return total


@dataclass(frozen=True)
class Served:
    """A running gunicorn: its base URL and its master's pid."""

    url: str
    pid: int


@contextmanager
def gunicorn(
    target: str,
    env: dict[str, str],
    workers: int,
    log_path: Path,
    *,
    args: tuple[str, ...] = (),
    ready_path: str = "/",
) -> Iterator[Served]:
    """Serve ``target`` with sync workers on a loopback port until the block ends."""
    port = free_port()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [
                str(BIN / "gunicorn"),
                "--bind",
                f"127.0.0.1:{port}",
                "--workers",
                str(workers),
                "--worker-class",
                "sync",
                "--graceful-timeout",
                "5",
                *args,
                target,
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"gunicorn {target} exited; see {log_path}")
            try:
                # An answer below 500 means the workers are up (and, from
                # /readyz, that the database and its schema are too).
                if requests.get(url + ready_path, timeout=1).status_code < 500:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"gunicorn {target} did not start; see {log_path}")
            time.sleep(0.1)
        yield Served(url, process.pid)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)


def wrk(url: str, load: Load, seconds: float, options: Options, workdir: Path) -> dict:
    """Run wrk with the scenario's script (and the reporting one); return its summary."""
    run_id = secrets.token_hex(4)  # fresh per wrk run: see scenarios.RUN_ID
    args = [run_id if arg == RUN_ID else arg for arg in load.args]
    script = workdir / f"{load.script}.{time.monotonic_ns()}.lua"
    script.write_text((LUA / load.script).read_text() + "\n" + (LUA / "report.lua").read_text())
    command = [
        "wrk",
        f"-t{options.threads}",
        f"-c{options.connections}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "5s",
        "-s",
        str(script),
        url,
        "--",
        *args,
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=seconds + 60, check=False
    )
    for line in result.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT ") :])
    raise RuntimeError(f"wrk printed no result:\n{result.stdout}\n{result.stderr}")


# -- the run ---------------------------------------------------------------------


def run_scenarios(
    db: str, db_url: str, names: list[str], options: Options, workdir: Path, n_round: int = 1
) -> list[Result]:
    """One round on one database: each scenario interleaved with the baseline, slice by slice.

    The baseline's gunicorn stays up for the round, beside the scenario's;
    wrk loads one of them at a time, alternating every slice (B S S B ...),
    so the two sides of a ratio share the machine's minute.
    """
    config_path = workdir / f"config-{db}.toml"
    context = Context(db=db, workdir=workdir, run_id=secrets.token_hex(4))
    # Scenarios may share a fragment (the same sources): include each once.
    fragments = list(dict.fromkeys(SCENARIOS[n].config for n in names))
    config_path.write_text(context.config_toml(fragments))
    env = app_env(db_url, config_path)
    migrate(env)
    results = []
    with ExitStack() as round_stack:
        baseline = _Side.start(round_stack, "baseline", db, env, options, workdir, context)
        others = [name for name in names if name != "baseline"]
        if not others:  # the baseline alone
            alone = baseline.measure(options.duration, options, workdir, n_round)
            results.append(_reported(alone, n_round))
        for name in others:
            with ExitStack() as stack:
                side = _Side.start(stack, name, db, env, options, workdir, context)
                sliced: dict[str, list[Result]] = {"baseline": [], name: []}
                seconds = options.duration / options.slices
                for i in range(options.slices):
                    for one in (baseline, side) if i % 2 == 0 else (side, baseline):
                        sliced[one.name].append(one.measure(seconds, options, workdir, n_round))
            for one in (baseline, side):
                results.append(_reported(_combined(sliced[one.name], against=name), n_round))
    return results


def _reported(result: Result, n_round: int) -> Result:
    """Print one run's line as the bench goes; return it."""
    beside = ""
    if result.scenario == "baseline" and result.against:
        beside = f"  (beside {result.against})"
    print(
        f"  round {n_round} {result.db:10} {result.scenario:18} {result.rps:8.0f} req/s  "
        f"p50 {result.p50_ms:.1f} ms  CPU {result.cpu_ms_per_request:.2f} ms/request{beside}",
        flush=True,
    )
    return result


@dataclass
class _Side:
    """One gunicorn of a round, loaded by wrk a slice at a time."""

    name: str
    db: str
    served: Served
    url: str
    load: Load

    @classmethod
    def start(
        cls,
        stack: ExitStack,
        name: str,
        db: str,
        env: dict[str, str],
        options: Options,
        workdir: Path,
        context: Context,
    ) -> _Side:
        scenario = SCENARIOS[name]
        log_path = workdir / f"gunicorn-{db}-{name}.log"
        served = stack.enter_context(gunicorn(scenario.app, env, options.workers, log_path))
        url = context.url = served.url
        if options.front == "nginx" and scenario.app == "wsgi:app":
            # The baseline stays direct: the ratios then show what the front costs.
            front = stack.enter_context(nginx(served.url, workdir / f"nginx-{db}-{name}"))
            url = context.url = front.url
        side = cls(name, db, served, url, scenario.prepare(context))
        if options.warmup > 0:
            wrk(side.url, side.load, options.warmup, options, workdir)
        return side

    def measure(self, seconds: float, options: Options, workdir: Path, n_round: int) -> Result:
        cpu_before = server_cpu(self.served.pid)
        summary = wrk(self.url, self.load, seconds, options, workdir)
        cpu_seconds = server_cpu(self.served.pid) - cpu_before
        return Result(
            scenario=self.name,
            db=self.db,
            requests=summary["requests"],
            seconds=summary["duration_us"] / 1e6,
            p50_ms=summary["p50_us"] / 1000,
            p99_ms=summary["p99_us"] / 1000,
            errors=sum(summary[k] for k in ("connect", "read", "write", "status", "timeout")),
            cpu_seconds=cpu_seconds,
            round=n_round,
        )


def _combined(slices: list[Result], against: str) -> Result:
    """A side's slices as one run: their totals, and the medians of their percentiles."""
    first = slices[0]
    return Result(
        scenario=first.scenario,
        db=first.db,
        requests=sum(r.requests for r in slices),
        seconds=sum(r.seconds for r in slices),
        p50_ms=statistics.median(r.p50_ms for r in slices),
        p99_ms=statistics.median(r.p99_ms for r in slices),
        errors=sum(r.errors for r in slices),
        cpu_seconds=sum(r.cpu_seconds for r in slices),
        round=first.round,
        against=against,
    )


def table(results: list[Result]) -> list[str]:
    """The results as Markdown table rows: medians over the rounds, ratios to the baseline.

    A row's ratio is the median of its rounds' ratios, each against the
    baseline slices interleaved with it in that round; so is its CPU ratio.
    The baseline's row takes all its slices of all rounds.
    """
    baseline = {(r.db, r.round, r.against): r for r in results if r.scenario == "baseline"}
    rows = [
        "| scenario | db | requests/s | p50 ms | p99 ms | errors | vs baseline "
        "| CPU ms/request | CPU vs baseline |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.scenario, r.db), []).append(r)
    for (scenario, db), runs in groups.items():
        ratios, cpu_ratios = [], []
        for r in runs:
            base = baseline.get((db, r.round, r.against))
            if base and base.rps:
                ratios.append(r.rps / base.rps)
            if base and r.cpu_ms_per_request and base.cpu_ms_per_request:
                cpu_ratios.append(r.cpu_ms_per_request / base.cpu_ms_per_request)
        cpu = statistics.median(r.cpu_ms_per_request for r in runs)
        rows.append(
            f"| {scenario} | {db} | {statistics.median(r.rps for r in runs):.0f} "
            f"| {statistics.median(r.p50_ms for r in runs):.1f} "
            f"| {statistics.median(r.p99_ms for r in runs):.1f} "
            f"| {sum(r.errors for r in runs)} "
            f"| {_median(ratios)} | {f'{cpu:.2f}' if cpu else '-'} | {_median(cpu_ratios)} |"
        )
    return rows


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def describe(options: Options, pg_url: str | None) -> list[str]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout
    return [
        f"- when: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, commit {commit or '?'}",
        f"- machine: {os.cpu_count()} CPUs, {platform.platform()}, "
        f"Python {platform.python_version()}",
        f"- server: gunicorn, {options.workers} sync workers, on 127.0.0.1"
        + (", behind nginx (deploy/nginx/; baseline direct)" if options.front else ""),
        f"- load: {(wrk_version.splitlines() or ['wrk'])[0].split(' [')[0]}, "
        f"{options.threads} thread(s), {options.connections} connections, "
        f"{options.warmup:g} s warm-up + {options.duration:g} s per scenario in "
        f"{options.slices} slice(s), each beside a slice of the baseline; "
        f"{options.rounds} round(s), medians over the rounds",
        "- PostgreSQL: "
        + (f"a fresh database on the server at {_host(pg_url)}" if pg_url else "skipped"),
        "- SQLite: a fresh file on disk, WAL, synchronous=FULL",
    ]


def _host(url: str | None) -> str:
    from sqlalchemy.engine import make_url

    parsed = make_url(url or "")
    return f"{parsed.host}:{parsed.port or 5432}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--duration", type=float, default=8, help="seconds of load per scenario")
    parser.add_argument("--warmup", type=float, default=1, help="seconds of warm-up first")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn sync workers")
    parser.add_argument("--connections", type=int, default=4, help="wrk connections")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of every scenario, each with its baseline"
    )
    parser.add_argument(
        "--slices",
        type=int,
        default=4,
        help="parts of each scenario's load, interleaved with as many of the baseline's",
    )
    parser.add_argument("--db", default="sqlite,postgresql", help="comma-separated databases")
    parser.add_argument(
        "--scenario", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}"
    )
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("BENCH_DATABASE_URL") or os.environ.get("TEST_DATABASE_URL"),
        help="PostgreSQL server (default: BENCH_DATABASE_URL, then TEST_DATABASE_URL)",
    )
    parser.add_argument("--profile", action="store_true", help="profile the API hot path instead")
    parser.add_argument(
        "--front", choices=["nginx"], default="", help="load the app through nginx (deploy/nginx/)"
    )
    args = parser.parse_args(argv)

    if args.profile:
        from .profile import profile

        return profile(args.pg_url)
    if shutil.which("wrk") is None:
        print(WRK_MISSING, file=sys.stderr)
        return 2
    names = [n for n in args.scenario.split(",") if n]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    if "baseline" in SCENARIOS and "baseline" not in names:
        names.insert(0, "baseline")  # every ratio needs its baseline
    options = Options(
        args.duration,
        args.warmup,
        args.workers,
        args.connections,
        args.threads,
        args.front,
        max(1, args.rounds),
        max(1, args.slices),
    )
    dbs = [d for d in args.db.split(",") if d]
    if "postgresql" in dbs and not args.pg_url:
        print("PostgreSQL skipped: set BENCH_DATABASE_URL or TEST_DATABASE_URL", file=sys.stderr)
        dbs.remove("postgresql")

    results: list[Result] = []
    workdir = Path(tempfile.mkdtemp(prefix="wr-bench-", dir=_disk_tmp()))
    try:
        for db in dbs:
            make = sqlite_database(workdir) if db == "sqlite" else postgresql_database(args.pg_url)
            with make as db_url:
                for n_round in range(1, options.rounds + 1):
                    results += run_scenarios(db, db_url, names, options, workdir, n_round)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    lines = [
        "# webhook-receiver benchmark",
        "",
        *describe(options, args.pg_url),
        "",
        *table(results),
    ]
    print()
    print("\n".join(table(results)))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"bench-{datetime.now(UTC):%Y%m%d-%H%M%S}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"\nwritten to {out.relative_to(ROOT)}")
    return 1 if any(r.errors for r in results) else 0


def _disk_tmp() -> str | None:
    # /tmp is often tmpfs, where fsync costs nothing and SQLite would look
    # faster than it is on a real disk.
    RESULTS.mkdir(exist_ok=True)
    return str(RESULTS)
