"""bin/supervise.py on its own: one per pidfile, the others kept up, the first one essential.

Small commands (``sleep``, ``sh -c``) stand in for gunicorn, the worker and
the consumer; tests/test_cli.py runs the real ones under ``make run``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

from .servers import ROOT, wait_until

SUPERVISE = ROOT / "bin" / "supervise.py"


def _module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("supervise", SUPERVISE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "supervise", module)  # its dataclass looks itself up
    spec.loader.exec_module(module)
    return module


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return found


def supervise(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the supervisor to its end: its status, stdout and stderr."""
    return subprocess.run(
        [sys.executable, str(SUPERVISE), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Supervisor:
    def __init__(self, process: subprocess.Popen[bytes], log_path: Path) -> None:
        self.process = process
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def supervising(tmp_path: Path, *commands: str, pidfile: Path) -> Iterator[Supervisor]:
    """A supervisor running ``commands``, started and, after the block, stopped."""
    log = tmp_path / f"supervise-{time.monotonic_ns()}.log"
    argv = [sys.executable, str(SUPERVISE), "--pidfile", str(pidfile)]
    for command in commands:
        argv += ["--", command]
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    supervisor = Supervisor(process, log)
    try:
        assert wait_until(lambda: "is running as pid" in supervisor.log(), timeout=10), (
            supervisor.log()
        )
        yield supervisor
    finally:
        left = _children(process.pid)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pid in left:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_second_supervisor_refuses_at_once_and_leaves_the_first_running(tmp_path):
    pidfile = tmp_path / "run.pid"
    with supervising(tmp_path, "sleep 60", "sleep 60", pidfile=pidfile) as first:
        pid = first.process.pid
        assert pidfile.read_text() == f"{pid}\n"
        children = _children(pid)
        assert len(children) == 2
        refusal = f"webhook-receiver is already running as pid {pid}; `make stop` first\n"

        started = time.monotonic()
        second = supervise("--pidfile", str(pidfile), "--", "sleep 61")
        assert time.monotonic() - started < 5
        assert (second.returncode, second.stderr) == (1, refusal)
        check = supervise("--pidfile", str(pidfile), "--check")
        assert (check.returncode, check.stderr) == (1, refusal)

        # The first is as it was: its pidfile, its processes.
        assert pidfile.read_text() == f"{pid}\n"
        assert first.process.poll() is None
        assert _children(pid) == children

        stop = supervise("--pidfile", str(pidfile), "--stop", timeout=60)
        assert (stop.returncode, stop.stdout) == (0, f"stopped (pid {pid})\n")
        assert first.process.poll() == 0
        assert not any(_alive(c) for c in children)
        assert not pidfile.exists()
    check = supervise("--pidfile", str(pidfile), "--check")
    assert (check.returncode, check.stderr) == (0, "")
    stop = supervise("--pidfile", str(pidfile), "--stop")
    assert (stop.returncode, stop.stdout) == (0, f"not running (no {pidfile})\n")


def test_a_stale_pidfile_is_taken_over_and_its_pid_never_signalled(tmp_path):
    pidfile = tmp_path / "run.pid"
    # A supervisor killed with -9 left its pidfile, and its pid is another process's now.
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        pidfile.write_text(f"{bystander.pid}\n")
        check = supervise("--pidfile", str(pidfile), "--check")
        assert (check.returncode, check.stderr) == (0, "")
        stop = supervise("--pidfile", str(pidfile), "--stop")
        assert (stop.returncode, stop.stdout) == (0, f"not running (removed the stale {pidfile})\n")
        assert not pidfile.exists()

        pidfile.write_text(f"{bystander.pid}\n")
        with supervising(tmp_path, "sleep 60", pidfile=pidfile) as supervisor:
            assert pidfile.read_text() == f"{supervisor.process.pid}\n"
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_a_supervisor_killed_with_sigkill_takes_its_commands_along(tmp_path):
    pidfile = tmp_path / "run.pid"
    with supervising(tmp_path, "sleep 60", "sleep 61", pidfile=pidfile) as killed:
        children = _children(killed.process.pid)
        killed.process.kill()
        killed.process.wait()
        assert wait_until(lambda: not any(_alive(c) for c in children), timeout=10)
        assert pidfile.read_text() == f"{killed.process.pid}\n"  # no one could remove it
        with supervising(tmp_path, "sleep 60", pidfile=pidfile) as next_one:
            assert pidfile.read_text() == f"{next_one.process.pid}\n"


def test_a_command_after_the_first_is_started_again_with_backoff(tmp_path):
    pidfile = tmp_path / "run.pid"
    with supervising(tmp_path, "sleep 60", "sh -c 'exit 3'", pidfile=pidfile) as supervisor:
        web = _children(supervisor.process.pid)[0]

        def restarted_twice() -> bool:
            return supervisor.log().count("started again as pid") >= 2

        assert wait_until(restarted_twice, timeout=10), supervisor.log()
        lines = supervisor.log().splitlines()
        exits = [line for line in lines if "exited" in line]
        assert exits[0].startswith("sh exit 3 (pid ")
        assert exits[0].endswith(") exited with status 3: starting it again in 1 s")
        assert exits[1].endswith(") exited with status 3: starting it again in 2 s")
        # The first command never noticed.
        assert supervisor.process.poll() is None
        assert _alive(web)
        # A stop while one waits to start again: it is not started.
        supervisor.process.send_signal(signal.SIGTERM)
        assert supervisor.process.wait(timeout=30) == 0
        assert not _alive(web)
        assert not pidfile.exists()


def test_a_killed_command_is_named_with_its_signal(tmp_path):
    pidfile = tmp_path / "run.pid"
    with supervising(tmp_path, "sleep 60", "sleep 61", pidfile=pidfile) as supervisor:
        children = _children(supervisor.process.pid)
        os.kill(children[1], signal.SIGKILL)
        assert wait_until(lambda: "started again" in supervisor.log(), timeout=10)
        assert (
            f"sleep 61 (pid {children[1]}) exited with signal SIGKILL: starting it again in 1 s"
            in supervisor.log()
        )
        assert len(_children(supervisor.process.pid)) == 2


def test_when_the_first_command_exits_the_others_stop_with_its_status(tmp_path):
    pidfile = tmp_path / "run.pid"
    with supervising(tmp_path, "sh -c 'sleep 1; exit 7'", "sleep 60", pidfile=pidfile) as sup:
        others = _children(sup.process.pid)
        assert sup.process.wait(timeout=30) == 7
        assert "exited with status 7: stopping the others" in sup.log()
        assert "started again" not in sup.log()
        assert not any(_alive(p) for p in others)
        assert not pidfile.exists()


def test_backoff_doubles_up_to_thirty_seconds_and_starts_over_after_a_minute_up(monkeypatch):
    supervise = _module(monkeypatch)
    now = 1000.0
    child = supervise.Child(["flask", "--app", "wsgi", "consume"], essential=False)
    assert child.name == "flask consume"

    def exit_after(seconds: float) -> float:
        nonlocal now
        child.started = now
        now += seconds
        return child.exited(now)

    assert [exit_after(0.5) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert exit_after(60) == 1
    assert exit_after(1) == 2


@pytest.mark.parametrize(
    "argv, error",
    [
        ([], "give at least one command after --"),
        (["--check"], "--check and --stop need --pidfile"),
        (["--pidfile", "p", "--check", "--stop"], "not allowed with argument"),
    ],
)
def test_usage_errors(argv, error):
    result = supervise(*argv)
    assert result.returncode == 2
    assert error in result.stderr


# Writes each signal it gets to the file named by its argument; exits on SIGTERM.
SIGNAL_LOGGER = """
import signal, sys, time
def note(signum, _frame):
    with open(sys.argv[1], "a") as fh:
        fh.write(signal.Signals(signum).name + "\\n")
    if signum == signal.SIGTERM:
        sys.exit(0)
signal.signal(signal.SIGINT, note)
signal.signal(signal.SIGTERM, note)
time.sleep(60)
"""


def test_ctrl_c_reaches_the_commands_only_as_the_supervisors_sigterm(tmp_path):
    # Ctrl-C in a terminal sends SIGINT to its whole foreground process group.
    # gunicorn takes SIGINT for a quick shutdown (its requests cut off), and
    # the worker would stop mid-delivery: the commands must get only the
    # supervisor's SIGTERM, which lets them finish what they do.
    script = tmp_path / "signals.py"
    script.write_text(SIGNAL_LOGGER)
    got = [tmp_path / "web.signals", tmp_path / "worker.signals"]
    log = tmp_path / "supervise.log"
    argv = [sys.executable, str(SUPERVISE), "--pidfile", str(tmp_path / "run.pid")]
    for path in got:
        argv += ["--", f"{sys.executable} {script} {path}"]
    with open(log, "wb") as out:
        # A session of its own, as a terminal gives `make run`.
        supervisor = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        assert wait_until(lambda: len(_children(supervisor.pid)) == 2, timeout=10)
        time.sleep(0.5)  # the commands' handlers are installed
        os.killpg(supervisor.pid, signal.SIGINT)
        assert supervisor.wait(timeout=30) == 0, log.read_text()
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
            supervisor.wait()
    assert [path.read_text() for path in got] == ["SIGTERM\n", "SIGTERM\n"]


def test_a_first_command_killed_by_a_signal_is_the_shells_status(tmp_path):
    # 128 + the signal, as a shell (and make) report it; not -9 % 256 = 247.
    pidfile = tmp_path / "run.pid"
    result = supervise("--pidfile", str(pidfile), "--", "sh -c 'sleep 0.5; kill -9 $$'")
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    assert "exited with signal SIGKILL: stopping the others" in result.stderr
