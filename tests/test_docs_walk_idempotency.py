"""docs/idempotency.md, "On a view of your own": its module served and its commands run.

The Python block is written to ``myapp.py`` and served by the gunicorn
command the section gives, with the sample configuration (its ``demo``
client), on each database; the console block runs in one bash session and
is matched as tests/test_readme.py matches the README's transcripts. The
order id is random: compared as any id, and the replay's with the first's.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import requests

from .checkout import bare_env
from .servers import BIN, ROOT, app_env, free_port, stop, wait_until
from .test_readme import Shell, console_blocks, matches

DOC = ROOT / "docs" / "idempotency.md"
SECTION = "On a view of your own"
_ORDER_ID = re.compile(r'"order_id":"[0-9a-f]{32}"')


def _section() -> str:
    text = DOC.read_text()
    assert f"## {SECTION}\n" in text, f"docs/idempotency.md has no section {SECTION!r}"
    start = text.index(f"## {SECTION}\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_the_documented_view_runs_once_per_key(db_url: str, tmp_path: Path) -> None:
    section = _section()
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, f"{SECTION!r} has no Python block"
    (tmp_path / "myapp.py").write_text(code.group(1))
    serve = re.search(r"`\.venv/bin/(gunicorn [^`]*myapp:app)`", section)
    assert serve, f"{SECTION!r} does not say how to serve the module"
    port = free_port()
    argv = shlex.split(serve.group(1).replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
    config = tmp_path / "config.toml"
    config.write_text((ROOT / "docs" / "config.example.toml").read_text())
    env = app_env(db_url, config, {"PYTHONPATH": f"{tmp_path}:{ROOT}"})
    log = tmp_path / "gunicorn.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [str(BIN / argv[0]), *argv[1:]],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    shell = Shell(tmp_path, bare_env())
    try:

        def up() -> bool:
            assert process.poll() is None, log.read_text()
            try:
                return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).ok
            except requests.RequestException:
                return False

        assert wait_until(up, timeout=60), log.read_text()
        blocks = [b for b in console_blocks(section) if b.commands]
        commands = [command for block in blocks for command in block.commands]
        assert len(commands) == 3
        ids = []
        for command in commands:
            text = command.text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
            output, status = shell.run(text)
            expected = [_ORDER_ID.sub('"order_id":"..."', line) for line in command.expected]
            assert status == 0, (text, output)
            assert matches(expected, output), "\n".join(
                ["$ " + text, "expected:", *command.expected, "got:", *output]
            )
            ids += _ORDER_ID.findall("\n".join(output))
        assert len(ids) == 2 and ids[0] == ids[1], ids
    finally:
        shell.close()
        stop(process)
