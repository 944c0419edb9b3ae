"""Scale-out measurement: app instances sharing one PostgreSQL database.

Runs, in one go and on loopback, a bounded load of signed Stripe deliveries
(unique events and redeliveries) against one gunicorn instance, then the
same load split round-robin across two instances (two masters on two ports,
as behind a load balancer), then a storm of duplicates sent to both
instances at once. Every scenario gets a fresh, migrated database on the
server at ``--database-url``; it is dropped afterwards.

It checks what the nodes must guarantee together: every delivery answered
2xx, one stored event per dedup key, and per key
``duplicate_count == deliveries - 1`` (its event_duplicates rows, once
the batch of redeliveries is written, within a second),
whichever instance took each copy. It prints a Markdown table.

    .venv/bin/python -m bench.scaleout --seconds 8
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import itertools
import json
import os
import platform
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import requests
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from bench.run import app_env, free_port, gunicorn, migrate
from webhook_receiver.config import database_uri

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "stripe-live"
STRIPE_SECRET = "whsec_bench_scaleout_0123456789"
CONFIG = f"""
[sources.{SOURCE}]
provider = "stripe"
secrets = ["{STRIPE_SECRET}"]
"""


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a live process has used, from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def family(pid: int) -> set[int]:
    """A gunicorn master and its workers."""
    pids = {pid}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                pids.add(int(entry.name))
    return pids


def stripe_delivery(key: str) -> tuple[bytes, dict[str, str]]:
    """A Stripe event signed as Stripe signs it: HMAC-SHA256 over ``<t>.<body>``."""
    body = json.dumps({"id": key, "type": "invoice.paid", "data": {"object": {"id": key}}})
    stamp = int(time.time())
    digest = hmac.new(STRIPE_SECRET.encode(), f"{stamp}.{body}".encode(), hashlib.sha256)
    return body.encode(), {
        "Stripe-Signature": f"t={stamp},v1={digest.hexdigest()}",
        "Content-Type": "application/json",
    }


@contextmanager
def database(admin_url: str, name: str) -> Iterator[str]:
    """A fresh database on the server, migrated by the real migrations, dropped at the end."""
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        migrate(app_env(url, write_config()))
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


_config_dir = Path(tempfile.mkdtemp(prefix="wr-scaleout-"))
# Configs and gunicorn logs; kept only when a run fails (the error names them).
_keep_config_dir = False


def write_config() -> Path:
    path = _config_dir / "config.toml"
    path.write_text(CONFIG)
    return path


@contextmanager
def instance(
    db_url: str, workers: int, env: dict[str, str] | None = None
) -> Iterator[tuple[str, int]]:
    """One app instance: a gunicorn master and its workers on a port of its own."""
    log_path = _config_dir / f"gunicorn-{secrets.token_hex(4)}.log"
    with gunicorn(
        "wsgi:app",
        app_env(db_url, write_config(), env),
        workers,
        log_path,
        args=("--access-logfile", "/dev/null"),
        ready_path="/readyz",
    ) as served:
        yield served.url, served.pid


@contextmanager
def pgbouncer(server_url: str) -> Iterator[int]:
    """A private pgbouncer in transaction mode in front of the server; yields its port."""
    server = make_url(server_url)
    root = Path(tempfile.mkdtemp(prefix="wr-pgbouncer-"))
    port = free_port()
    (root / "users.txt").write_text(f'"{server.username}" ""\n')
    (root / "pgbouncer.ini").write_text(
        f"""[databases]
* = host={server.host or "127.0.0.1"} port={server.port or 5432}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {root}/users.txt
pool_mode = transaction
default_pool_size = 4
max_client_conn = 200
logfile = {root}/pgbouncer.log
pidfile = {root}/pgbouncer.pid
"""
    )
    command = ["pgbouncer"]
    if os.geteuid() == 0:  # it refuses to run as root
        import pwd

        entry = pwd.getpwnam("postgres")
        for path in (root, *root.iterdir()):
            os.chown(path, entry.pw_uid, entry.pw_gid)
        command += ["-u", "postgres"]
    process = subprocess.Popen(
        [*command, str(root / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer did not start: see {root}") from None
                time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)


@dataclass(frozen=True)
class Answer:
    instance: int
    kind: str  # unique | redelivery | storm
    key: str
    status: int | None
    seconds: float
    replayed: bool
    event_id: int | None


@dataclass
class Journal:
    answers: list[Answer] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def post(self, session: requests.Session, urls: list[str], n: int, kind: str, key: str):
        body, headers = stripe_delivery(key)
        started = time.perf_counter()
        try:
            response = session.post(
                f"{urls[n]}/webhooks/{SOURCE}", data=body, headers=headers, timeout=30
            )
        except requests.RequestException:
            status, replayed, event_id = None, False, None
        else:
            status = response.status_code
            replayed = response.headers.get("Idempotent-Replayed") == "true"
            event_id = response.json().get("event_id") if status == 200 else None
        answer = Answer(n, kind, key, status, time.perf_counter() - started, replayed, event_id)
        with self.lock:
            self.answers.append(answer)
        return answer


def run_load(urls: list[str], seconds: float, clients: int, redelivery_share: float) -> Journal:
    """Unique deliveries and redeliveries, dealt round-robin to the instances, for ``seconds``."""
    journal = Journal()
    sent: list[str] = []
    turn = itertools.count()
    serial = itertools.count()
    deadline = time.monotonic() + seconds

    def client(c: int) -> None:
        rng = random.Random(c)
        sessions = [requests.Session() for _ in urls]
        while time.monotonic() < deadline:
            n = next(turn) % len(urls)
            if sent and rng.random() < redelivery_share:
                journal.post(sessions[n], urls, n, "redelivery", rng.choice(sent))
            else:
                key = f"evt_{next(serial)}"
                if journal.post(sessions[n], urls, n, "unique", key).status == 200:
                    sent.append(key)
        for session in sessions:
            session.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return journal


def run_storm(urls: list[str], keys: int, copies: int, clients: int) -> Journal:
    """``copies`` of each of ``keys`` deliveries at once, alternating between instances."""
    journal = Journal()
    plan = [(f"evt_storm_{k}", c % len(urls)) for k in range(keys) for c in range(copies)]
    random.Random(7).shuffle(plan)
    barrier = threading.Barrier(clients)

    def client(c: int) -> None:
        sessions = [requests.Session() for _ in urls]
        barrier.wait(timeout=30)
        for key, n in plan[c::clients]:
            journal.post(sessions[n], urls, n, "storm", key)
        for session in sessions:
            session.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return journal


@contextmanager
def connection_sampler(db_url: str) -> Iterator[list[int]]:
    """Sample how many server connections the app holds, every 0.2 s, while the block runs."""
    samples: list[int] = []
    stop = threading.Event()
    engine = create_engine(db_url, pool_size=1)
    name = make_url(db_url).database

    def sample() -> None:
        with engine.connect() as conn:
            while not stop.wait(0.2):
                count = conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE datname = :name AND pid <> pg_backend_pid()"
                    ),
                    {"name": name},
                ).scalar()
                conn.rollback()
                samples.append(int(count or 0))

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()
        engine.dispose()


def verify(db_url: str, journal: Journal) -> dict[str, int]:
    """Check the guarantees across nodes; raise AssertionError on the first breach."""
    answers = journal.answers
    failed = [a for a in answers if a.status != 200]
    assert not failed, (
        f"{len(failed)} deliveries not answered 200: {Counter(a.status for a in failed)}"
    )
    per_key: dict[str, list[Answer]] = defaultdict(list)
    for answer in answers:
        per_key[answer.key].append(answer)
    # Redeliveries are counted in batches, within DUPLICATE_FLUSH_SECONDS
    # (1 s) of their answer: read until every count is in, or 10 s have passed.
    deadline = time.monotonic() + 10
    while True:
        stored = _stored(db_url, per_key)
        counted = all(
            key in stored and stored[key][2] >= len(tries) - 1 for key, tries in per_key.items()
        )
        if counted or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(stored) == set(per_key), "an acknowledged delivery was not stored"
    crossed = 0
    for key, tries in per_key.items():
        n, event_id, dups = stored[key]
        assert n == 1, f"{key} stored {n} times"
        assert {a.event_id for a in tries} == {event_id}, key
        assert sum(not a.replayed for a in tries) == 1, f"{key}: not exactly one first receipt"
        assert dups == len(tries) - 1, f"{key}: {dups} duplicates for {len(tries)}"
        crossed += len({a.instance for a in tries}) > 1
    return {
        "keys": len(per_key),
        "duplicates": sum(len(t) - 1 for t in per_key.values()),
        "keys_seen_by_both": crossed,
    }


def _stored(db_url: str, keys: Iterable[str]) -> dict[str, tuple[int, int, int]]:
    """Per key: how many events, the event's id, and its duplicate count (its rows)."""
    engine = create_engine(db_url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT e.dedup_key, count(*) OVER (PARTITION BY e.dedup_key), e.id,"
                " (SELECT count(*) FROM event_duplicates d WHERE d.event_id = e.id)"
                " FROM events e WHERE e.source = :source"
            ),
            {"source": SOURCE},
        ).all()
    engine.dispose()
    # Only these keys: the storm runs on the database the load filled.
    wanted = set(keys)
    return {key: (n, event_id, dups) for key, n, event_id, dups in rows if key in wanted}


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def backend_pids(db_url: str) -> set[int]:
    """The server processes serving this database (readable when the server is local)."""
    engine = create_engine(db_url)
    with engine.connect() as conn:
        pids = conn.execute(
            text("SELECT pid FROM pg_stat_activity WHERE datname = :name"),
            {"name": make_url(db_url).database},
        ).scalars()
        result = set(pids)
    engine.dispose()
    return result


@dataclass
class CpuMeter:
    """CPU seconds used by a set of processes between ``start`` and ``stop``."""

    pids: set[int] = field(default_factory=set)
    before: dict[int, float] = field(default_factory=dict)
    used: float = 0.0

    def start(self, pids: set[int]) -> None:
        self.before = {pid: cpu_seconds(pid) for pid in pids}

    def stop(self, pids: set[int]) -> None:
        self.used = sum(cpu_seconds(pid) - self.before.get(pid, 0.0) for pid in pids)


@dataclass
class Result:
    label: str
    round: int
    instances: int
    journal: Journal
    seconds: float
    app_cpu: list[float]
    db_cpu: float
    connections: int
    checked: dict[str, int]

    def rows(self) -> list[str]:
        lines = []
        total_app = sum(self.app_cpu)
        whos: list[int | None] = [*range(self.instances), None] if self.instances > 1 else [None]
        for n in whos:
            picked = [a for a in self.journal.answers if n is None or a.instance == n]
            ms = [a.seconds * 1000 for a in picked]
            unique = sum(a.kind == "unique" for a in picked)
            app = total_app if n is None else self.app_cpu[n]
            db = f"{self.db_cpu * 1000 / len(picked):.1f}" if n is None and picked else ""
            who = "total" if n is None else f"instance {n + 1}"
            lines.append(
                f"| {self.label} | {self.round} | {who} | {len(picked)} | {unique} "
                f"| {len(picked) - unique} | {len(picked) / self.seconds:.0f} "
                f"| {percentile(ms, 0.5):.1f} | {percentile(ms, 0.99):.1f} "
                f"| {app * 1000 / max(1, len(picked)):.1f} | {db} |"
            )
        return lines


def scenario(
    admin_url: str, tag: str, instances: int, n_round: int, args: argparse.Namespace
) -> tuple[Result, dict[str, int] | None]:
    """Run the load (and, on several instances, the storm) on a fresh database."""
    label = f"{instances} × {args.workers} workers"
    storm_result = None
    with ExitStack() as stack:
        db_url = stack.enter_context(
            database(admin_url, f"wr_scaleout_{tag}_{n_round}_{instances}")
        )
        started_instances = [
            stack.enter_context(instance(db_url, args.workers)) for _ in range(instances)
        ]
        urls = [url for url, _ in started_instances]
        apps = [CpuMeter() for _ in started_instances]
        database_cpu = CpuMeter()
        for meter, (_, pid) in zip(apps, started_instances, strict=True):
            meter.start(family(pid))
        database_cpu.start(backend_pids(db_url))
        with connection_sampler(db_url) as samples:
            started = time.monotonic()
            journal = run_load(urls, args.seconds, args.clients, args.redeliveries)
            elapsed = time.monotonic() - started
        for meter, (_, pid) in zip(apps, started_instances, strict=True):
            meter.stop(family(pid))
        database_cpu.stop(backend_pids(db_url))
        checked = verify(db_url, journal)
        if instances > 1 and n_round == 1:
            storm = run_storm(urls, args.storm_keys, args.storm_copies, args.clients * 2)
            storm_result = verify(db_url, storm)
    result = Result(
        label,
        n_round,
        instances,
        journal,
        elapsed,
        [m.used for m in apps],
        database_cpu.used,
        max(samples, default=0),
        checked,
    )
    return result, storm_result


# psycopg prepares a statement on the server after five runs on one
# connection; pgbouncer before 1.21 cannot follow a prepared statement from
# one transaction's server connection to the next. None turns it off.
NO_PREPARE = json.dumps({"connect_args": {"connect_timeout": 5, "prepare_threshold": None}})


def through_pgbouncer(
    admin_url: str, tag: str, args: argparse.Namespace, prepare: bool
) -> tuple[str, Counter[int | None], dict[str, int] | None]:
    """The two-instance load with every app connection going through pgbouncer."""
    label = "2 instances via pgbouncer (transaction mode), " + (
        "psycopg defaults" if prepare else "prepare_threshold=None"
    )
    env = {} if prepare else {"WEBHOOK_RECEIVER_SQLALCHEMY_ENGINE_OPTIONS": NO_PREPARE}
    with ExitStack() as stack:
        db_url = stack.enter_context(
            database(admin_url, f"wr_scaleout_{tag}_bouncer_{int(prepare)}")
        )
        port = stack.enter_context(pgbouncer(db_url))
        pooled_url = make_url(db_url).set(host="127.0.0.1", port=port)
        pooled = pooled_url.render_as_string(hide_password=False)
        urls = [url for url, _ in (stack.enter_context(instance(pooled, 2, env)) for _ in "ab")]
        journal = run_load(urls, args.seconds / 2, args.clients, args.redeliveries)
        statuses = Counter(a.status for a in journal.answers)
        checked = verify(db_url, journal) if set(statuses) == {200} else None
    return label, statuses, checked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL")
        or os.environ.get("TEST_DATABASE_URL")
        or "postgresql://postgres@127.0.0.1:5432/postgres",
        help="a PostgreSQL server where throwaway databases may be created",
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="load per scenario")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the scenarios")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers per instance")
    parser.add_argument("--clients", type=int, default=8, help="client threads")
    parser.add_argument("--redeliveries", type=float, default=0.3, help="share of redeliveries")
    parser.add_argument(
        "--pgbouncer",
        action=argparse.BooleanOptionalAction,
        default=shutil.which("pgbouncer") is not None,
        help="also run through a private pgbouncer in transaction mode",
    )
    parser.add_argument("--storm-keys", type=int, default=20)
    parser.add_argument("--storm-copies", type=int, default=20)
    args = parser.parse_args(argv)
    admin_url = database_uri(args.database_url, str(ROOT))
    tag = f"{os.getpid()}_{secrets.token_hex(3)}"

    results: list[Result] = []
    storm = None
    # Alternate the scenarios, so that a neighbour's burst of load on this
    # shared machine does not favour one of them.
    for n_round in range(1, args.rounds + 1):
        for instances in (1, 2):
            result, storm_checked = scenario(admin_url, tag, instances, n_round, args)
            results.append(result)
            storm = storm or storm_checked
    bounced = []
    if args.pgbouncer:
        for prepare in (True, False):
            bounced.append(through_pgbouncer(admin_url, tag, args, prepare))

    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    print(
        f"Measured {when} on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, load average {load[0]:.1f} at the end; "
        f"{args.clients} client threads on the same machine, {args.seconds:g} s per "
        f"scenario, {args.redeliveries:.0%} redeliveries, dealt round-robin.\n"
    )
    print(
        "| scenario | round | instance | requests | unique | redeliveries | req/s "
        "| p50 ms | p99 ms | app CPU ms/req | DB CPU ms/req |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for result in results:
        print("\n".join(result.rows()))
    print()
    for result in results:
        checked = result.checked
        print(
            f"- {result.label}, round {result.round}: {checked['keys']} events, "
            f"{checked['duplicates']} duplicates counted exactly, "
            f"{checked['keys_seen_by_both']} keys answered by both instances, 0 stored "
            f"twice; at most {result.connections} server connections"
        )
    if storm is not None:
        print(
            f"- storm across both instances: {args.storm_keys} keys × {args.storm_copies} "
            f"copies at once, alternating instances: {storm['keys']} events, each "
            f"duplicate_count = {args.storm_copies - 1}, {storm['keys_seen_by_both']} keys "
            "answered by both, 0 stored twice"
        )
    for label, statuses, checked in bounced:
        answers = ", ".join(
            f"{count} × {status or 'no answer'}" for status, count in statuses.items()
        )
        verdict = (
            f"{checked['keys']} events, {checked['duplicates']} duplicates counted exactly"
            if checked
            else "not all answered 200"
        )
        print(f"- {label}: {answers}; {verdict}")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except Exception:
        _keep_config_dir = True
        print(f"logs kept in {_config_dir}", file=sys.stderr)
        raise
    finally:
        if not _keep_config_dir:
            shutil.rmtree(_config_dir, ignore_errors=True)
    sys.exit(status)
