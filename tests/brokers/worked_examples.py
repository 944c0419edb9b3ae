"""docs/brokers.md's worked examples, run as written: a section's TOML table and console block.

The source table is the section's ``toml`` block; each ``$ flask --app wsgi
...`` line of its ``console`` block is run with the Flask CLI runner, and
its output compared with the lines under it (the names the test makes
unique swapped in, an entry id that differs per run aside), but ``consume``,
which the test runs in a thread until the event is stored.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from typing import Any

from flask import Flask

from ..servers import ROOT

DOCS = ROOT / "docs" / "brokers.md"
_PREFIX = "$ flask --app wsgi "
# A Redis entry id: milliseconds and a sequence number.
_ENTRY_ID = re.compile(r"\b\d{13,}-\d+\b")


def example(title: str) -> tuple[str, dict[str, Any], list[tuple[list[str], list[str]]]]:
    """The section's source (name, table) and its commands, each with its expected lines."""
    section = DOCS.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(toml|console)\n(.*?)```", section, re.S)
    tables = tomllib.loads(next(text for kind, text in blocks if kind == "toml"))
    [(name, table)] = tables["sources"].items()
    commands: list[tuple[list[str], list[str]]] = []
    for line in next(text for kind, text in blocks if kind == "console").splitlines():
        if line.startswith(_PREFIX):
            commands.append((shlex.split(line.removeprefix(_PREFIX)), []))
        else:
            commands[-1][1].append(line)
    return name, table, commands


def run(app: Flask, args: list[str], expected: list[str], swap: dict[str, str]) -> None:
    """Run one command as the docs show it; its output must be the docs' lines."""
    result = app.test_cli_runner().invoke(args=[_swapped(arg, swap) for arg in args])
    assert result.exit_code == 0, result.output
    shown = [_ENTRY_ID.sub("<id>", line) for line in result.output.splitlines()]
    assert shown == [_ENTRY_ID.sub("<id>", _swapped(line, swap)) for line in expected]


def _swapped(text: str, swap: dict[str, str]) -> str:
    for old, new in swap.items():
        text = text.replace(old, new)
    return text
