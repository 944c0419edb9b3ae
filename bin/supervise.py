"""Run several processes as one: ``make run``'s web server, worker (and any consumers).

    python bin/supervise.py --pidfile instance/run.pid -- CMD ... -- CMD ...
    python bin/supervise.py --pidfile instance/run.pid --check
    python bin/supervise.py --pidfile instance/run.pid --stop

Each ``--`` starts one command (split like a shell would, without one). The
first command is the web server: when it exits, the others are stopped and
this exits with its status (128 + the signal, as a shell says, if one killed
it). Any other command that exits is started again,
after 1 s, then twice as long after each quick exit, up to 30 s (back to 1 s
once it has stayed up a minute); each exit and each start again is one line
on stderr. One SIGTERM or SIGINT to this process (its pid is printed and
written to the pidfile) stops them all: each gets SIGTERM, so gunicorn
finishes its requests and the worker its current delivery. Each command
runs in a process group of its own, which gets the signal (SIGKILL if it has
not stopped after 30 s): Ctrl-C's SIGINT reaches this process only, not
gunicorn, which would take it for a quick shutdown. Make passes the
SIGTERM it receives on to this process, so ``kill <make's pid>`` stops
everything as well.

The pidfile is locked (``flock``) for as long as this process runs, before
any command starts: a second one given the same pidfile refuses at once,
starts nothing and leaves the file alone. A pidfile that no process holds
(its process was killed) is stale, and taken over. ``--check`` only says
whether one runs (status 1 if so); ``--stop`` stops the one that runs and
waits until it has.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

GRACE_SECONDS = 30
FIRST_BACKOFF = 1.0
MAX_BACKOFF = 30.0
# A command that stayed up this long before exiting starts again after FIRST_BACKOFF.
STABLE_SECONDS = 60.0
# --check and --stop hold the lock for an instant: a start at that instant waits it out.
LOCK_PATIENCE = 0.5
POLL = 0.2
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _commands(argv: list[str]) -> tuple[argparse.Namespace, list[list[str]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pidfile", help="lock and write this process's pid here while it runs")
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--check", action="store_true", help="exit 1 if one runs with this pidfile, else 0"
    )
    action.add_argument("--stop", action="store_true", help="stop the one running with it")
    segments: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--":
            segments.append([])
        else:
            segments[-1].append(arg)
    options = parser.parse_args(segments[0])
    # A command given as one argument ("gunicorn --bind ...") is split like a shell would.
    commands = [shlex.split(s[0]) if len(s) == 1 else s for s in segments[1:] if s]
    if (options.check or options.stop) and not options.pidfile:
        parser.error("--check and --stop need --pidfile")
    if not (options.check or options.stop or commands):
        parser.error("give at least one command after --")
    return options, commands


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the pidfile ----------------------------------------------------------------


def _lock(path: str, *, create: bool = True, patience: float = LOCK_PATIENCE) -> int | None:
    """Lock the pidfile at ``path``: its descriptor, or None if another process holds it.

    Without ``create``, a missing file raises FileNotFoundError instead of being made.
    """
    deadline = time.monotonic() + patience
    while True:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
            continue
        # The holder may have removed the file between our open and our lock:
        # then this lock is on a file no one else can open; lock the path's.
        if _is(fd, path):
            return fd
        os.close(fd)
        if not create and not os.path.exists(path):
            raise FileNotFoundError(path)


def _is(fd: int, path: str) -> bool:
    """Whether ``path`` names the file open as ``fd``."""
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(path: str) -> str:
    """The pid written in a pidfile that is held (read again while its holder writes it)."""
    deadline = time.monotonic() + 2
    while True:
        try:
            with open(path) as fh:
                text = fh.read().strip()
        except FileNotFoundError:
            text = ""
        if text.isdigit() or time.monotonic() >= deadline:
            return text or "?"
        time.sleep(0.05)


def _refuse(path: str) -> int:
    _say(f"webhook-receiver is already running as pid {_holder(path)}; `make stop` first")
    return 1


def check(path: str) -> int:
    """Exit status 1, with the refusal on stderr, when a supervisor holds ``path``."""
    try:
        fd = _lock(path, create=False)
    except FileNotFoundError:
        return 0
    if fd is None:
        return _refuse(path)
    os.close(fd)  # stale: the start that follows takes it over
    return 0


def stop(path: str) -> int:
    """Stop the supervisor holding ``path`` and wait until it has stopped everything."""
    try:
        fd = _lock(path, create=False)
    except FileNotFoundError:
        print(f"not running (no {path})", flush=True)
        return 0
    if fd is not None:
        # No process holds it: a supervisor killed before it could clean up.
        # Its pid may be another process's by now, so nothing is signalled.
        os.unlink(path)
        os.close(fd)
        print(f"not running (removed the stale {path})", flush=True)
        return 0
    pid = _holder(path)
    if not pid.isdigit():
        _say(f"cannot stop: {path} is held but names no pid")
        return 1
    try:
        os.kill(int(pid), signal.SIGTERM)
    except ProcessLookupError:
        pass  # stopping already
    # It removes the file, still locked, once it has stopped its commands.
    while True:
        try:
            fd = _lock(path, create=False, patience=0)
        except FileNotFoundError:
            break
        if fd is not None:
            os.close(fd)
            break
        time.sleep(POLL)
    deadline = time.monotonic() + 5
    while _alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"stopped (pid {pid})", flush=True)
    return 0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True


# -- the commands ---------------------------------------------------------------


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"status {returncode}"


def _end_with_parent(parent: int) -> Callable[[], None]:
    """What a child runs before its command: to get SIGTERM should this process die (Linux).

    So that a supervisor killed with SIGKILL, which cannot stop its commands,
    leaves none of them running without it.
    """

    def before_exec() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            return  # not Linux: they outlive it, as before
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)  # it died before the prctl took effect

    return before_exec


@dataclass
class Child:
    """One command, its running process (None while it waits to start again) and its backoff."""

    command: list[str]
    essential: bool
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    backoff: float = FIRST_BACKOFF
    due: float = 0.0

    @property
    def name(self) -> str:
        # "gunicorn wsgi:app", "flask worker", "flask consume": the program and its last word.
        words = [os.path.basename(self.command[0])]
        if len(self.command) > 1 and not self.command[-1].startswith("-"):
            words.append(self.command[-1])
        return " ".join(words)

    def start(self) -> None:
        # A process group of its own: Ctrl-C (SIGINT to the terminal's
        # foreground group) reaches only this process, which passes it on as
        # SIGTERM. gunicorn takes SIGINT for a quick shutdown, its requests
        # cut off; and the group is what _signal reaches, with what it started.
        self.process = subprocess.Popen(
            self.command, preexec_fn=_end_with_parent(os.getpid()), process_group=0
        )
        self.started = time.monotonic()

    def exited(self, now: float) -> float:
        """Note an exit at ``now``; the seconds to wait before starting again."""
        self.process = None
        if now - self.started >= STABLE_SECONDS:
            self.backoff = FIRST_BACKOFF
        delay = self.backoff
        self.backoff = min(self.backoff * 2, MAX_BACKOFF)
        self.due = now + delay
        return delay


def _restart(child: Child) -> None:
    try:
        child.start()
    except OSError as exc:
        delay = child.exited(time.monotonic())
        _say(f"{child.name} could not start ({exc}): trying again in {delay:g} s")
        return
    assert child.process is not None
    _say(f"{child.name} started again as pid {child.process.pid}")


def _signal(process: subprocess.Popen[bytes], signum: int) -> None:
    """Send ``signum`` to the command's process group: the command and what it started."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass  # the group is gone: the command exited and left nothing behind


def _stop_all(children: list[Child]) -> None:
    running = [c.process for c in children if c.process is not None]
    for process in running:
        if process.poll() is None:
            _signal(process, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for process in running:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(process, signal.SIGKILL)
            process.wait()


def _exit_status(returncode: int) -> int:
    """A command's status as a shell reports it: 128 + the signal that killed it."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str]) -> int:
    """Start the commands; keep the others up while the first runs; stop them all when told to."""
    options, commands = _commands(argv)
    if options.check:
        return check(options.pidfile)
    if options.stop:
        return stop(options.pidfile)
    stopping = False

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    lock = None
    if options.pidfile:
        lock = _lock(options.pidfile)
        if lock is None:
            return _refuse(options.pidfile)
        data = f"{os.getpid()}\n".encode()
        os.pwrite(lock, data, 0)
        os.ftruncate(lock, len(data))
    children = [Child(command, essential=n == 0) for n, command in enumerate(commands)]
    status = 0
    try:
        for child in children:
            child.start()
        _say(
            f"webhook-receiver is running as pid {os.getpid()}: "
            f"stop it with Ctrl-C, `kill {os.getpid()}` or `make stop`"
        )
        while not stopping:
            for child in children:
                if stopping:
                    break
                if child.process is None:
                    if time.monotonic() >= child.due:
                        _restart(child)
                    continue
                returncode = child.process.poll()
                if returncode is None:
                    continue
                pid = child.process.pid
                if child.essential:
                    status = _exit_status(returncode)
                    _say(
                        f"{child.name} (pid {pid}) exited with {_describe(returncode)}: "
                        "stopping the others"
                    )
                    stopping = True
                    break
                delay = child.exited(time.monotonic())
                _say(
                    f"{child.name} (pid {pid}) exited with {_describe(returncode)}: "
                    f"starting it again in {delay:g} s"
                )
            else:
                time.sleep(POLL)
    finally:
        _stop_all(children)
        if lock is not None:
            # Removed while still locked: a start that opened it meanwhile sees
            # it is gone. Only if it is still ours (not removed and made anew).
            if _is(lock, options.pidfile):
                os.unlink(options.pidfile)
            os.close(lock)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
