"""docs/providers.md, "Sign a delivery by hand": its console blocks, run as written.

The first block appends the sources to ``instance/config.toml``; gunicorn
then starts with that file, on each database, and every other command runs
in one bash session (the blocks share shell variables), its output matched
against the transcript as tests/test_readme.py matches the README's. Event
ids depend on what the database holds, so they are compared as any number.
"""

from __future__ import annotations

import re
from pathlib import Path

from .checkout import bare_env
from .servers import ROOT, gunicorn
from .test_readme import Command, Shell, console_blocks, matches

DOC = ROOT / "docs" / "providers.md"
SECTION = "Sign a delivery by hand"
_EVENT_ID = re.compile(r'"event_id":\d+')


def _section_commands() -> list[Command]:
    blocks = [b for b in console_blocks(DOC.read_text()) if b.heading == SECTION]
    return [command for block in blocks for command in block.commands]


def test_the_hand_signed_deliveries_are_received_as_written(db_url: str, tmp_path: Path) -> None:
    commands = _section_commands()
    assert commands, f"docs/providers.md has no console blocks under {SECTION!r}"
    config, *rest = commands
    assert config.text.startswith("cat >> instance/config.toml")
    texts = "\n".join(c.text for c in rest)
    for path in ("/webhooks/stripe", "/webhooks/github", "/webhooks/standard"):
        assert path in texts

    (tmp_path / "instance").mkdir()
    shell = Shell(tmp_path, bare_env())
    try:
        output, status = shell.run(config.text)
        assert status == 0 and output == config.expected, output
        toml = (tmp_path / "instance" / "config.toml").read_text()
        with gunicorn(db_url, toml, tmp_path) as server:
            for command in rest:
                text = command.text.replace("http://127.0.0.1:8000", server.url)
                output, status = shell.run(text)
                expected = [_EVENT_ID.sub('"event_id":...', line) for line in command.expected]
                assert status == 0, (text, output)
                assert matches(expected, output), "\n".join(
                    ["$ " + text, "expected:", *command.expected, "got:", *output]
                )
    finally:
        shell.close()
