"""A Google Cloud Pub/Sub for the tests: the emulator, once per session, on a free port.

The Debian package ``google-cloud-cli-pubsub-emulator`` ships the emulator
(a Java server) with the Cloud SDK; its start script is run directly, as
``gcloud beta emulators pubsub start`` would. It keeps everything in
memory, so each test creates its own topics and subscriptions.

:func:`host` starts it the first time it is called in a process and returns
``"127.0.0.1:PORT"``, the value of ``PUBSUB_EMULATOR_HOST`` through which
google-cloud-pubsub (the consumer's and the tests') reaches it; it is
stopped when the process exits. ``TEST_PUBSUB_EMULATOR_HOST`` points the
tests at an emulator already running instead.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

STARTUP_SECONDS = 60.0
# Where the Debian package puts the start script (the Cloud SDK's platform folder).
SCRIPT = "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator"

_lock = threading.Lock()
_process: subprocess.Popen[bytes] | None = None
_host: str | None = None
_log: Path | None = None


def script() -> str:
    """The emulator's start script, or RuntimeError naming the package that ships it."""
    found = shutil.which("cloud-pubsub-emulator") or SCRIPT
    if not os.access(found, os.X_OK):
        raise RuntimeError(
            f"no Pub/Sub emulator at {found}: install google-cloud-cli-pubsub-emulator"
        )
    return found


def host() -> str:
    """The emulator's ``host:port``, started first if this process has none yet."""
    global _process, _host, _log
    given = os.environ.get("TEST_PUBSUB_EMULATOR_HOST")
    if given:
        return given
    with _lock:
        if _host is not None and _process is not None and _process.poll() is None:
            return _host
        port = _free_port()
        fd, log_name = tempfile.mkstemp(prefix="pubsub-emulator-", suffix=".log")
        _log = Path(log_name)
        with os.fdopen(fd, "wb") as log:
            _process = subprocess.Popen(
                [script(), "--host=127.0.0.1", f"--port={port}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        atexit.register(_stop)
        _wait_started(port)
        _host = f"127.0.0.1:{port}"
        return _host


def log_text() -> str:
    """What the session's emulator wrote so far (for an assertion's message)."""
    return _log.read_text(errors="replace")[-4000:] if _log else ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_started(port: int) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if _process is not None and _process.poll() is not None:
            raise RuntimeError(
                f"the Pub/Sub emulator exited with status {_process.returncode}:\n{log_text()}"
            )
        # It listens a moment before it serves: its own line says when it does.
        if "Server started" in log_text():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                pass
        time.sleep(0.1)
    raise RuntimeError(
        f"the Pub/Sub emulator did not start on 127.0.0.1:{port} within {STARTUP_SECONDS} s"
    )


def _stop() -> None:
    global _process, _host
    process, _process, _host = _process, None, None
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
    if _log is not None:
        _log.unlink(missing_ok=True)
