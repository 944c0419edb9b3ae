"""nginx in front of a running gunicorn, with the repository's config, on a loopback port.

Used by ``python -m bench --front nginx`` and by the slow-client tests. The
site config in ``deploy/nginx/webhook-receiver.conf`` is used as it is, with
two lines changed: where it listens and where gunicorn is. nginx runs as the
current user, in the foreground, with every file it writes (pid, logs,
request bodies) in a folder of its own.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "deploy" / "nginx" / "webhook-receiver.conf"
NGINX_MISSING = "nginx is not installed: sudo apt-get install -y nginx"


@dataclass
class Front:
    """A running nginx: its base URL, its process and its folder."""

    url: str
    process: subprocess.Popen[bytes]
    prefix: Path

    def error_log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def render(port: int, upstream: str, prefix: Path) -> str:
    """The whole nginx.conf: the repository's site on ``port``, proxying to ``upstream``."""
    site = SITE.read_text()
    site, listens = re.subn(r"(?m)^(\s*)listen\s+80;", rf"\1listen 127.0.0.1:{port};", site)
    site, servers = re.subn(r"server 127\.0\.0\.1:8000;", f"server {upstream};", site)
    if listens != 1 or servers != 1:
        raise RuntimeError(f"{SITE}: expected one 'listen 80;' and one upstream server line")
    temp = prefix / "temp"
    for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (temp / name).mkdir(parents=True, exist_ok=True)
    # As root, nginx would hand the workers to "nobody", who cannot enter
    # this folder; as anyone else, it keeps the current user.
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""{user}worker_processes 1;
error_log {prefix / "error.log"} warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {temp / "body"};
    proxy_temp_path {temp / "proxy"};
    fastcgi_temp_path {temp / "fastcgi"};
    uwsgi_temp_path {temp / "uwsgi"};
    scgi_temp_path {temp / "scgi"};
{site}
}}
"""


@contextmanager
def nginx(upstream_url: str, prefix: Path) -> Iterator[Front]:
    """Run nginx in front of ``upstream_url`` (http://host:port) until the block ends."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        raise RuntimeError(NGINX_MISSING)
    prefix.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(render(port, upstream_url.removeprefix("http://"), prefix))
    command = [
        binary,
        "-p",
        str(prefix),
        "-c",
        str(conf),
        "-e",
        str(prefix / "error.log"),
        "-g",
        f"daemon off; pid {prefix / 'nginx.pid'};",
    ]
    with open(prefix / "stderr.log", "ab") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    front = Front(f"http://127.0.0.1:{port}", process, prefix)
    try:
        deadline = time.monotonic() + 15
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"nginx exited:\n{front.error_log()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nginx did not start:\n{front.error_log()}") from None
                time.sleep(0.05)
        yield front
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGQUIT)  # graceful: finish what is in flight
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)


def paired(rounds: int = 6, seconds: int = 3) -> list[tuple[float, float]]:
    """Requests/s on /healthz, straight on gunicorn and through nginx, interleaved.

    One gunicorn (2 sync workers, SQLite) serves both, and each pair runs
    back to back, so a machine whose load changes from minute to minute
    moves both sides of a pair alike: the ratios stay comparable where
    separate runs of ``python -m bench`` are not.
    """
    import tempfile

    from .run import app_env, gunicorn, migrate

    def rate(url: str) -> float:
        command = ["wrk", "-t1", "-c4", f"-d{seconds}s", url + "/healthz"]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        found = re.search(r"Requests/sec:\s+([\d.]+)", out)
        if found is None:
            raise RuntimeError(f"wrk printed no rate:\n{out}")
        return float(found.group(1))

    work = Path(tempfile.mkdtemp(prefix="wr-front-"))
    (work / "config.toml").write_text("")
    env = app_env(f"sqlite:///{work / 'db.sqlite3'}", work / "config.toml")
    migrate(env)
    pairs = []
    with (
        gunicorn("wsgi:app", env, 2, work / "gunicorn.log", ready_path="/healthz") as served,
        nginx(served.url, work / "nginx") as front,
    ):
        rate(served.url)  # warm-up, both ways
        rate(front.url)
        for _ in range(rounds):
            pairs.append((rate(served.url), rate(front.url)))
            print(f"direct {pairs[-1][0]:7.0f} req/s   nginx {pairs[-1][1]:7.0f} req/s", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return pairs


if __name__ == "__main__":
    import statistics

    measured = paired()
    ratio = statistics.median(n / d for d, n in measured)
    print(f"median ratio nginx/direct: {ratio:.2f}")
