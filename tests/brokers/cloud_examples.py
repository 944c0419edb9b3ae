"""docs/brokers.md's SQS and Pub/Sub examples, run as written, the broker's ids aside.

A section's source is its ``toml`` block, its commands the ``$ flask --app
wsgi ...`` lines of its ``console`` block, each followed by the lines it
prints. A ``publish`` line shows the id the broker gave the message, which
differs per run: the id the docs show is swapped for the one printed
before the lines are compared.
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

# "(MessageId <id>)" on SQS, "(message id <id>)" on Pub/Sub.
_MESSAGE_ID = re.compile(r"\((?:MessageId|message id) ([^)\s]+)\)")


def example(title: str) -> tuple[str, dict[str, Any], list[tuple[list[str], list[str]]]]:
    """The section's source (name, table) and its commands, each with the lines it prints."""
    section = DOCS.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    blocks = dict(re.findall(r"```(toml|console)\n(.*?)```", section, re.S))
    [(name, table)] = tomllib.loads(blocks["toml"])["sources"].items()
    commands: list[tuple[list[str], list[str]]] = []
    for line in blocks["console"].splitlines():
        if line.startswith(_PREFIX):
            commands.append((shlex.split(line.removeprefix(_PREFIX)), []))
        else:
            commands[-1][1].append(line)
    return name, table, commands


def run(app: Flask, args: list[str], expected: list[str], swap: dict[str, str]) -> str | None:
    """Run one command as the docs show it; its output must be the docs' lines. The id printed."""
    result = app.test_cli_runner().invoke(args=[_swapped(arg, swap) for arg in args])
    assert result.exit_code == 0, result.output
    wanted = [_swapped(line, swap) for line in expected]
    printed = _MESSAGE_ID.search(result.output)
    shown = _MESSAGE_ID.search("\n".join(wanted))
    if printed and shown:
        old, new = shown.group(1), printed.group(1)
        for where in (" {})", "'{}' (the broker's"):
            wanted = [line.replace(where.format(old), where.format(new)) for line in wanted]
    assert result.output.splitlines() == wanted, (result.output, wanted)
    return printed.group(1) if printed else None


def _swapped(text: str, swap: dict[str, str]) -> str:
    for old, new in swap.items():
        text = text.replace(old, new)
    return text
