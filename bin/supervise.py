"""Run several processes as one: ``make run``'s web server, worker (and any consumers).

    python bin/supervise.py --pidfile instance/run.pid -- CMD ... -- CMD ...

Each ``--`` starts one command (split like a shell would, without one). One
SIGTERM or SIGINT to this process (its pid is printed and written to the
pidfile) stops them all: each gets SIGTERM, so gunicorn finishes its
requests and the worker its current delivery. When one of them exits on
its own, the others are stopped too, and this exits with its status. Make
passes the SIGTERM it receives on to this process, so ``kill <make's pid>``
stops everything as well.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from types import FrameType

GRACE_SECONDS = 30


def _commands(argv: list[str]) -> tuple[argparse.Namespace, list[list[str]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pidfile", help="write this process's pid here while it runs")
    segments: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--":
            segments.append([])
        else:
            segments[-1].append(arg)
    options = parser.parse_args(segments[0])
    # A command given as one argument ("gunicorn --bind ...") is split like a shell would.
    commands = [shlex.split(s[0]) if len(s) == 1 else s for s in segments[1:] if s]
    if not commands:
        parser.error("give at least one command after --")
    return options, commands


def main(argv: list[str]) -> int:
    """Start the commands, then stop them all when told to or when one ends."""
    options, commands = _commands(argv)
    stopping = False

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if options.pidfile:
        with open(options.pidfile, "w") as fh:
            fh.write(f"{os.getpid()}\n")
    children = [subprocess.Popen(command) for command in commands]
    print(
        f"webhook-receiver is running as pid {os.getpid()}: "
        f"stop it with Ctrl-C, `kill {os.getpid()}` or `make stop`",
        file=sys.stderr,
        flush=True,
    )
    status = 0
    try:
        while not stopping:
            ended = [c for c in children if c.poll() is not None]
            if ended:
                status = ended[0].returncode
                name = os.path.basename(commands[children.index(ended[0])][0])
                print(f"{name} exited ({status}): stopping the others", file=sys.stderr, flush=True)
                break
            time.sleep(0.2)
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        for child in children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if options.pidfile:
            try:
                os.unlink(options.pidfile)
            except FileNotFoundError:
                pass
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
