"""An MQTT 5 broker for the tests: Debian's Mosquitto, started once per session on a free port.

The tests' own broker, not the machine's: its sessions keep every message
(``max_queued_messages 0``; Mosquitto's default, 1,000, drops the rest of a
backlog), and it logs every packet, so that a test can tell how many
messages the broker sent a client and how many PUBACKs came back
(:meth:`Mosquitto.count`). It keeps nothing on disk.

:func:`broker` starts it the first time it is called in a process; it is
stopped when the process exits. ``TEST_MQTT_URL`` is not read: the counts
need the log.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from .session_server import end, free_port

STARTUP_SECONDS = 15.0
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
# The log lines counted: a PUBLISH sent to a client, a PUBACK received from
# one, a PUBLISH received from one.
SENT = "Sending PUBLISH to"
ACKED = "Received PUBACK from"
PUBLISHED = "Received PUBLISH from"
_LINE = re.compile(rf"^\d+: ({SENT}|{ACKED}|{PUBLISHED}) (\S+) \((d\d)?")


class Mosquitto:
    """A running Mosquitto: its port, and what its log says each client was sent and acked."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.process = process
        self.port = port
        self.log = log
        self._offset = 0
        self._partial = b""
        self._counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def count(self, what: str, client_id: str, *, redelivered: bool = False) -> int:
        """How many ``SENT``, ``ACKED`` or ``PUBLISHED`` lines name ``client_id``.

        ``redelivered``: only those with DUP set (a message sent again).
        """
        with self._lock:
            with open(self.log, "rb") as log:
                log.seek(self._offset)
                data = self._partial + log.read()
                self._offset = log.tell()
            *lines, self._partial = data.split(b"\n")
            for line in lines:
                found = _LINE.match(line.decode("utf-8", "replace"))
                if found:
                    self._counts[(found[1], found[2])] += 1
                    if found[3] == "d1":
                        self._counts[(found[1] + " again", found[2])] += 1
            return self._counts[(what + (" again" if redelivered else ""), client_id)]

    def tail(self) -> str:
        """The end of the broker's log, for an assertion's message."""
        return self.log.read_text(errors="replace")[-3000:]


_lock = threading.Lock()
_broker: Mosquitto | None = None


def broker() -> Mosquitto:
    """The session's Mosquitto, started first if this process has none running."""
    global _broker
    with _lock:
        if _broker is not None and _broker.process.poll() is None:
            return _broker
        _broker = start()
        atexit.register(_broker_stop)
        return _broker


def start(*, log_everything: bool = True) -> Mosquitto:
    """Start a Mosquitto of its own on a free 127.0.0.1 port (stop it with :func:`stop`)."""
    if not os.path.exists(MOSQUITTO):
        raise RuntimeError(f"{MOSQUITTO} not found (Debian's mosquitto package)")
    port = free_port()
    # Run as root, Mosquitto drops to its own user: its folder must let it write.
    folder = Path(tempfile.mkdtemp(prefix="mosquitto-"))
    folder.chmod(0o1777)
    log = folder / "mosquitto.log"
    config = folder / "mosquitto.conf"
    config.write_text(
        f"listener {port} 127.0.0.1\n"
        "allow_anonymous true\n"
        "persistence false\n"
        "max_queued_messages 0\n"
        f"log_dest file {log}\n"
        f"log_type {'all' if log_everything else 'error'}\n"
    )
    process = subprocess.Popen(
        [MOSQUITTO, "-c", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mosquitto exited with status {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            if log.exists():
                return Mosquitto(process, port, log)
            time.sleep(0.05)
        except OSError:
            time.sleep(0.05)
    stop(Mosquitto(process, port, log))
    raise RuntimeError(f"mosquitto did not listen on 127.0.0.1:{port} within {STARTUP_SECONDS} s")


def stop(server: Mosquitto) -> None:
    """Stop a Mosquitto started here, and remove its folder."""
    end(server.process)
    shutil.rmtree(server.log.parent, ignore_errors=True)


def _broker_stop() -> None:
    global _broker
    server, _broker = _broker, None
    if server is not None:
        stop(server)
