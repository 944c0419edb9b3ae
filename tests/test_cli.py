"""The flask commands after ``make run``'s set-up, with nothing exported; one-line errors; make run.

Each test works in a fresh checkout (tests/checkout.py): its own instance
folder, written by the Makefile as ``make run`` writes it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
import requests
from sqlalchemy import create_engine, text

from .checkout import bare_env, fresh_checkout, run
from .databases import throwaway_postgresql
from .helpers import unavailable
from .servers import free_port, wait_until

SETUP = "make instance/config.toml instance/secret_key && .venv/bin/flask --app wsgi db upgrade"


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout set up as ``make run`` sets it up, without starting anything."""
    root = fresh_checkout(tmp_path)
    result = run(root, SETUP)
    assert result.returncode == 0, result.stdout
    return root


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout  # no traceback
    assert lines[0].startswith("Error: ")
    return lines[0]


def test_purge_after_make_runs_setup_needs_nothing_exported(checkout):
    result = run(checkout, ".venv/bin/flask --app wsgi purge")
    assert result.returncode == 0, result.stdout
    assert "purged 0 event(s) past retention" in result.stdout


def test_purge_finds_the_secret_key_of_make_run_when_the_admin_is_on(checkout):
    # With the admin on, the key is needed: it is read from instance/secret_key.
    env = bare_env(WEBHOOK_RECEIVER_ADMIN_PASSWORD="a password for the admin")
    result = run(checkout, ".venv/bin/flask --app wsgi purge", env)
    assert result.returncode == 0, result.stdout


def test_worker_drain_after_make_runs_setup_needs_nothing_exported(checkout):
    result = run(checkout, ".venv/bin/flask --app wsgi worker --drain")
    assert result.returncode == 0, result.stdout
    assert "worker processed 0 deliveries" in result.stdout


def test_a_missing_secret_key_is_one_line_naming_the_fix(checkout):
    (checkout / "instance" / "secret_key").unlink()
    env = bare_env(WEBHOOK_RECEIVER_ADMIN_PASSWORD="a password for the admin")
    line = _one_line_error(run(checkout, ".venv/bin/flask --app wsgi purge", env))
    assert "SECRET_KEY is missing" in line
    assert "make instance/secret_key" in line


def test_purge_before_the_migrations_is_one_line_naming_the_fix(tmp_path):
    root = fresh_checkout(tmp_path)
    line = _one_line_error(run(root, ".venv/bin/flask --app wsgi purge"))
    assert "flask --app wsgi db upgrade" in line


def test_purge_on_an_empty_postgresql_database_says_to_migrate(checkout):
    with throwaway_postgresql("wr_cli") as (url, _admin, _name):
        result = run(checkout, ".venv/bin/flask --app wsgi purge", bare_env(DATABASE_URL=url))
    line = _one_line_error(result)
    assert "no schema yet" in line
    assert "flask --app wsgi db upgrade" in line


def test_a_database_that_does_not_exist_is_not_taken_for_a_missing_schema(checkout):
    with throwaway_postgresql("wr_cli") as (url, _admin, name):
        missing = url.replace(name, name + "_missing")
        result = run(checkout, ".venv/bin/flask --app wsgi purge", bare_env(DATABASE_URL=missing))
    assert "cannot be reached" in _one_line_error(result)


def test_purge_with_the_database_down_is_one_line(checkout):
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/nothing"
    line = _one_line_error(
        run(checkout, ".venv/bin/flask --app wsgi purge", bare_env(DATABASE_URL=url))
    )
    assert "cannot be reached" in line
    assert "DATABASE_URL" in line


UPGRADE = ".venv/bin/flask --app wsgi db upgrade"


def _with_options(url: str, options: str) -> str:
    return f"{url}?options={options.replace(' ', '%20').replace('=', '%3D')}"


def test_an_upgrade_behind_another_ones_lock_says_so_not_that_the_database_is_away(checkout):
    # The deployment guide's lock_timeout on the URL: the wait for another
    # upgrade runs out. The database answered: it is not "cannot be reached".
    found = re.search(
        r"MIGRATION_LOCK_KEY = (0x[0-9A-Fa-f_]+)",
        (Path(__file__).parents[1] / "migrations" / "env.py").read_text(),
    )
    assert found is not None
    with throwaway_postgresql("wr_cli") as (url, admin, _name):
        assert run(checkout, UPGRADE, bare_env(DATABASE_URL=url)).returncode == 0
        holder = create_engine(url)
        try:
            with holder.connect() as conn:
                conn.execute(text(f"SELECT pg_advisory_lock({int(found.group(1), 0)})"))
                env = bare_env(DATABASE_URL=_with_options(url, "-c lock_timeout=1s"))
                result = run(checkout, UPGRADE, env)
        finally:
            holder.dispose()
    # Alembic's INFO lines come first; then the error, one line, no traceback.
    assert result.returncode != 0
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("Error: ") and "Traceback" not in result.stdout, result.stdout
    assert "locked by another session" in line, line
    assert "lock_timeout" in line and "cannot be reached" not in line


def test_a_purge_past_its_statement_timeout_says_so_not_that_the_database_is_away(checkout):
    with throwaway_postgresql("wr_cli") as (url, admin, _name):
        assert run(checkout, UPGRADE, bare_env(DATABASE_URL=url)).returncode == 0
        holder = create_engine(url)
        try:
            with holder.begin() as conn:
                # The purge's reads and deletes wait behind this lock until cancelled.
                conn.execute(text("LOCK TABLE events IN ACCESS EXCLUSIVE MODE"))
                env = bare_env(DATABASE_URL=_with_options(url, "-c statement_timeout=1000"))
                line = _one_line_error(run(checkout, ".venv/bin/flask --app wsgi purge", env))
        finally:
            holder.dispose()
    assert "ran past its time limit" in line, line
    assert "statement_timeout" in line and "cannot be reached" not in line


# -- make run and make stop ----------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except FileNotFoundError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def _children(pid: int) -> dict[int, str]:
    """The child processes of ``pid``, each with its command line."""
    found = {}
    for child in _descendants(pid):
        try:
            if int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            found[child] = Path(f"/proc/{child}/cmdline").read_text().replace("\0", " ")
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def _healthy(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).ok
    except requests.RequestException:
        return False


def _make_run(root: Path, port: int) -> tuple[subprocess.Popen[bytes], set[int]]:
    log = open(root / "make-run.log", "wb")  # noqa: SIM115 - closed with the process
    make = subprocess.Popen(
        ["make", "run", f"BIND=127.0.0.1:{port}", "WORKERS=1"],
        cwd=root,
        env=bare_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    try:
        assert wait_until(lambda: _healthy(port), timeout=60), (root / "make-run.log").read_text()
        # The supervisor, gunicorn's master and worker, and the delivery worker.
        assert wait_until(lambda: len(_descendants(make.pid)) >= 4, timeout=30)
    except BaseException:
        for pid in _descendants(make.pid):
            os.kill(pid, signal.SIGKILL)
        make.kill()
        make.wait()
        raise
    return make, _descendants(make.pid)


@pytest.mark.slow
def test_one_sigterm_to_make_run_stops_every_process(checkout):
    make, processes = _make_run(checkout, free_port())
    try:
        make.send_signal(signal.SIGTERM)
        make.wait(timeout=60)
        assert wait_until(lambda: not any(_alive(p) for p in processes), timeout=30), [
            p for p in processes if _alive(p)
        ]
        assert not (checkout / "instance" / "run.pid").exists()
    finally:
        for pid in processes:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_make_stop_stops_what_make_run_started(checkout):
    make, processes = _make_run(checkout, free_port())
    try:
        printed = (checkout / "make-run.log").read_text()
        pid = int((checkout / "instance" / "run.pid").read_text())
        assert f"running as pid {pid}" in printed
        result = run(checkout, "make stop")
        assert result.returncode == 0, result.stdout
        assert f"stopped (pid {pid})" in result.stdout
        make.wait(timeout=60)
        assert not any(_alive(p) for p in processes)
    finally:
        for pid in processes:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _stop_make_run(make: subprocess.Popen[bytes], processes: set[int]) -> None:
    """Stop a ``make run`` (if still running) and kill whatever of it is left."""
    processes = processes | _descendants(make.pid)
    if make.poll() is None:
        make.send_signal(signal.SIGTERM)
        try:
            make.wait(timeout=60)
        except subprocess.TimeoutExpired:
            make.kill()
            make.wait()
    for pid in processes:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_second_make_run_refuses_at_once_and_make_stop_stops_the_first(checkout):
    port = free_port()
    make, processes = _make_run(checkout, port)
    try:
        pidfile = checkout / "instance" / "run.pid"
        pid = int(pidfile.read_text())
        # On another port, so that a second server, had one started, would answer.
        other = free_port()
        started = time.monotonic()
        second = run(checkout, f"make run BIND=127.0.0.1:{other} WORKERS=1", timeout=60)
        assert time.monotonic() - started < 15
        assert second.returncode != 0
        assert f"webhook-receiver is already running as pid {pid}; `make stop` first" in (
            second.stdout
        )
        assert "db upgrade" not in second.stdout  # refused before the migrations
        assert not _healthy(other)
        # The first is untouched: its pidfile, its processes, its answers.
        assert pidfile.read_text() == f"{pid}\n"
        assert _descendants(make.pid) == processes
        assert _healthy(port)

        result = run(checkout, "make stop")
        assert result.returncode == 0, result.stdout
        assert f"stopped (pid {pid})" in result.stdout
        assert make.wait(timeout=60) == 0
        assert not any(_alive(p) for p in processes)
        assert not pidfile.exists()
    finally:
        _stop_make_run(make, processes)


RABBIT_URL = os.environ.get("TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


@pytest.fixture
def amqp_queue() -> Iterator[str]:
    """A throwaway RabbitMQ queue, deleted afterwards (RabbitMQ down: skipped, failed in CI)."""
    name = f"wr-test-{uuid.uuid4().hex[:10]}"
    try:
        connection = pika.BlockingConnection(pika.URLParameters(RABBIT_URL))
    except Exception as exc:
        unavailable(f"RabbitMQ is not reachable: {type(exc).__name__}: {exc}")
    try:
        connection.channel().queue_declare(name)
    finally:
        connection.close()
    yield name
    connection = pika.BlockingConnection(pika.URLParameters(RABBIT_URL))
    try:
        connection.channel().queue_delete(name)
    finally:
        connection.close()


def _consumers_of(queue: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(RABBIT_URL))
    try:
        return connection.channel().queue_declare(queue, passive=True).method.consumer_count
    finally:
        connection.close()


@pytest.mark.slow
def test_a_killed_consumer_under_make_run_is_started_again_and_the_server_answers(
    checkout, amqp_queue
):
    with open(checkout / "instance" / "config.toml", "a") as config:
        config.write(
            f'\n[sources.orders]\nprovider = "rabbitmq"\nurl = "{RABBIT_URL}"\n'
            f'queue = "{amqp_queue}"\n'
        )
    port = free_port()
    make, processes = _make_run(checkout, port)
    try:
        supervisor = int((checkout / "instance" / "run.pid").read_text())

        def consumer() -> int | None:
            found = [p for p, cmd in _children(supervisor).items() if cmd.endswith(" consume ")]
            return found[0] if found else None

        assert wait_until(lambda: consumer() is not None and _consumers_of(amqp_queue) == 1, 30)
        killed = consumer()
        assert killed is not None
        others = {p: cmd for p, cmd in _children(supervisor).items() if p != killed}
        os.kill(killed, signal.SIGKILL)

        answers = []

        def back() -> bool:
            answers.append(_healthy(port))
            again = consumer()
            return again not in (None, killed) and _consumers_of(amqp_queue) == 1

        assert wait_until(back, timeout=20, interval=0.2), (checkout / "make-run.log").read_text()
        assert all(answers), answers  # /healthz answered throughout
        # gunicorn and the worker are the same processes as before.
        assert {p: c for p, c in _children(supervisor).items() if p in others} == others
        log = (checkout / "make-run.log").read_text()
        assert f"flask consume (pid {killed}) exited with signal SIGKILL" in log
        assert f"flask consume started again as pid {consumer()}" in log
        assert _healthy(port)

        result = run(checkout, "make stop")
        assert f"stopped (pid {supervisor})" in result.stdout
        assert make.wait(timeout=60) == 0
    finally:
        _stop_make_run(make, processes)


def test_commands_are_wrapped_once_however_many_apps_a_process_makes(tmp_path):
    from webhook_receiver import create_app

    def build():
        return create_app(
            {
                "TESTING": True,
                "SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 'w.sqlite3'}",
                "RECEIVER_CONFIG": {},
            }
        )

    for _ in range(3):
        app = build()
    # Each app used to wrap the shared command objects again, until a process
    # that made enough apps hit the recursion limit running one.
    for name in ("purge", "worker", "consume"):
        invoke = app.cli.commands[name].invoke
        assert hasattr(invoke, "__wrapped__")
        assert not hasattr(invoke.__wrapped__, "__wrapped__"), name


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["deliveries", "attempts", str(2**63)], "EVENT_ID"),
        (["deliveries", "attempts", "99999999999999999999"], "EVENT_ID"),
        (["deliveries", "replay", "--event", str(2**63)], "--event"),
        (["deliveries", "replay", "--limit", str(2**63), "--dry-run"], "--limit"),
        (["deliveries", "replay", "--since", "9999-12-31T23:00-05:00", "--dry-run"], "--since"),
        (["deliveries", "replay", "--until", "0001-01-01T00:00+05:00", "--dry-run"], "--until"),
        (["deliveries", "replay", "--source", "a\x00b", "--dry-run"], "--source"),
        (["deliveries", "replay", "--consumer", "a\x00b", "--dry-run"], "--consumer"),
        (["deliveries", "replay", "--type", "a\x00b", "--dry-run"], "--type"),
        (["deliveries", "replay", "--event", "1", "--consumer", "a\x00b"], "--consumer"),
        (["deliveries", "replay", "--rest", "nan", "--dry-run"], "--rest"),
        (["deliveries", "replay", "--rest", "inf", "--dry-run"], "--rest"),
    ],
)
def test_deliveries_arguments_the_database_cannot_take_are_usage_errors(runner, args, named):
    # Each passed click's own checks, then reached the driver (an id or count
    # past 64 bits, a time out of range once in UTC, a NUL for PostgreSQL) and
    # ended in a traceback; a rest of NaN or infinity broke or stalled the
    # replay after its first batch. Now each is a usage error naming the option.
    result = runner.invoke(args=args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Error: Invalid value for" in result.output and named in result.output
    assert "Traceback" not in result.output
