"""The README's production web server command ("Run it for real"), run as written.

It is meant to sit behind the reverse proxy the same list asks for, with
``WEBHOOK_RECEIVER_TRUSTED_PROXIES`` set: gunicorn must then listen where
only the proxy reaches it, or a client sending straight to it escapes the
proxy's read timeouts and writes its own address in ``X-Forwarded-For``.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import requests

from .servers import BIN, ROOT, app_env, free_port, stop, wait_until

README = ROOT / "README.md"


def _web_server_command() -> str:
    match = re.search(r"^- \*\*Web server\*\*: `(gunicorn [^`]+)`", README.read_text(), re.M)
    assert match, "README's 'Run it for real' has no Web server command"
    return match.group(1)


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                addresses.add(address)
    return addresses


def test_the_readme_web_server_listens_on_loopback_only(db_url: str, tmp_path: Path) -> None:
    command = _web_server_command()
    port = free_port()
    argv = shlex.split(re.sub(r":8000\b", f":{port}", command))
    config = tmp_path / "config.toml"
    config.write_text('[clients.acme]\ntoken = "a-long-random-token-0123"\n')
    log = tmp_path / "gunicorn.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [str(BIN / argv[0]), *argv[1:]],
            cwd=ROOT,
            env=app_env(db_url, config, {"WEBHOOK_RECEIVER_TRUSTED_PROXIES": "1"}),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def up() -> bool:
            assert process.poll() is None, log.read_text()
            try:
                return requests.get(f"http://127.0.0.1:{port}/readyz", timeout=1).ok
            except requests.RequestException:
                return False

        assert wait_until(up, timeout=60), log.read_text()
        assert _listening(port) == {"0100007F"}, (command, _listening(port))
    finally:
        stop(process)
