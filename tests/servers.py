"""Real server processes for tests: gunicorn running the app, and loopback helpers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

from .conftest import SECRET_KEY
from .session_server import free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def worker_pids(master_pid: int) -> set[int]:
    """The gunicorn master's live child processes, read from /proc."""
    children = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it ended while we looked
        # The command name is in parentheses and may hold spaces: split after it.
        fields = stat[stat.rindex(")") + 2 :].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == master_pid and state != "Z":
            children.add(int(entry.name))
    return children


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def app_env(db_url: str, config_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that points a real process at this test's database and config."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLASK_", "WEBHOOK_RECEIVER_")) and k not in ("DATABASE_URL",)
    }
    env.update(
        DATABASE_URL=db_url,
        SECRET_KEY=SECRET_KEY,
        WEBHOOK_RECEIVER_CONFIG=str(config_path),
        PYTHONPATH=str(ROOT),
    )
    env.update(extra or {})
    return env


@contextmanager
def gunicorn(
    db_url: str,
    config_toml: str,
    tmp_path: Path,
    *,
    workers: int = 2,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> Iterator[Server]:
    """Run the app under gunicorn on a free loopback port until the block ends."""
    config_path = tmp_path / f"config-{time.monotonic_ns()}.toml"
    config_path.write_text(config_toml)
    port = free_port()
    log_path = tmp_path / f"gunicorn-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                str(BIN / "gunicorn"),
                "--bind",
                f"127.0.0.1:{port}",
                "--workers",
                str(workers),
                "--graceful-timeout",
                "5",
                *args,
                "wsgi:app",
            ],
            cwd=ROOT,
            env=app_env(db_url, config_path, env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(f"http://127.0.0.1:{port}", process, log_path)
    try:
        if not wait_until(lambda: _healthy(server), timeout=60):
            raise RuntimeError(f"gunicorn did not start:\n{server.log()}")
        yield server
    finally:
        stop(process)


def _healthy(server: Server) -> bool:
    if server.process.poll() is not None:
        raise RuntimeError(f"gunicorn exited early:\n{server.log()}")
    try:
        return requests.get(server.url + "/healthz", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def stop(process: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """Stop a process (and its group) gently, then firmly."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout)
    except ProcessLookupError:
        pass


def read_http_request(conn: socket.socket) -> bytes | None:
    """One HTTP/1.1 request read from ``conn`` (head and Content-Length body); None if it closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        body += chunk
    return head + b"\r\n\r\n" + body


class Relay:
    """A TCP relay on loopback in front of a server, which can stop passing the server's bytes on.

    After ``hold()`` the client's bytes still reach the server, and what the
    server answers is dropped: a broker that is alive but says nothing back
    (``release()`` passes it on again). ``close()`` ends every relayed
    connection (the client sees them closed).
    """

    def __init__(self, port: int, *, hold_after: bytes | None = None) -> None:
        self._target = port
        # Hold once the server has sent these bytes on a connection (a
        # protocol's handshake passed, the next answer dropped).
        self._hold_after = hold_after
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._holding = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self._holding.set()

    def release(self) -> None:
        self._holding.clear()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(("127.0.0.1", self._target))
            except OSError:
                client.close()  # the server is away: the client sees a closed connection
                continue
            with self._lock:
                self._sockets += [client, server]
                closed = self._closed
            if closed:
                client.close()
                server.close()
                return
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _held(self, _server: socket.socket) -> bool:
        """Whether the answers coming from this server-side socket are dropped."""
        return self._holding.is_set()

    def _pass_on(self, data: bytes, sink: socket.socket, _from_server: bool) -> None:
        """Send ``data`` on to the other side (a subclass may slow or reshape it)."""
        sink.sendall(data)

    def _pipe(self, source: socket.socket, sink: socket.socket, from_server: bool) -> None:
        sent = b""
        try:
            while data := source.recv(65536):
                if not (from_server and self._held(source)):
                    self._pass_on(data, sink, from_server)
                if from_server and self._hold_after is not None and not self._holding.is_set():
                    sent += data
                    if self._hold_after in sent:
                        self._holding.set()
        except OSError:
            pass
        # Either side gone: both are closed, and the other direction ends too.
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
