"""A test server a test process starts once, on a free loopback port, and stops when it exits.

The Kafka (Tansu), SQS (moto) and Pub/Sub (emulator) test servers are
each one of these: their modules say what to run and how to tell it is
ready; this one starts it the first time it is asked for (under a lock,
for the tests' threads), keeps its output in a log file for assertion
messages, and stops it at exit. Standalone (no app, no pytest): the
benchmarks start the same servers.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


class SessionServer:
    """One server process for this test process: ``port()`` starts it, if need be."""

    def __init__(
        self,
        name: str,
        command: Callable[[int], list[str]],
        *,
        startup_seconds: float = 30.0,
        ready_line: str | None = None,
        **popen: Any,
    ) -> None:
        # ``ready_line``: a server that listens a moment before it serves
        # says when it does in its output; ``popen``: cwd, preexec_fn...
        self.name = name
        self._command = command
        self._startup_seconds = startup_seconds
        self._ready_line = ready_line
        self._popen = popen
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._log: Path | None = None

    def port(self) -> int:
        """The running server's port, started first if this process has none yet."""
        with self._lock:
            if self._port is not None and self._process is not None:
                if self._process.poll() is None:
                    return self._port
            port = free_port()
            prefix = "".join(c if c.isalnum() else "-" for c in self.name)
            fd, log_name = tempfile.mkstemp(prefix=f"{prefix}-", suffix=".log")
            self._log = Path(log_name)
            with os.fdopen(fd, "wb") as log:
                self._process = subprocess.Popen(
                    self._command(port),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    **self._popen,
                )
            atexit.register(self.stop)
            self._wait_ready(port)
            self._port = port
            return port

    def log_text(self) -> str:
        """What the server wrote so far (for an assertion's message)."""
        return self._log.read_text(errors="replace")[-4000:] if self._log else ""

    def stop(self) -> None:
        """Stop the server, gently then firmly, and remove its log."""
        process, self._process, self._port = self._process, None, None
        if process is not None:
            end(process)
        if self._log is not None:
            self._log.unlink(missing_ok=True)

    def _wait_ready(self, port: int) -> None:
        deadline = time.monotonic() + self._startup_seconds
        while time.monotonic() < deadline:
            process = self._process
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {process.returncode}:\n{self.log_text()}"
                )
            said = self._ready_line is None or self._ready_line in self.log_text()
            if said and listening(port):
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"{self.name} did not start on 127.0.0.1:{port} within {self._startup_seconds} s"
        )


def end(process: subprocess.Popen[Any]) -> None:
    """End a test server's process, gently then firmly (a no-op once it has exited)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
