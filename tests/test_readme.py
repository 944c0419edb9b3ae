"""The README's guide, run as a newcomer would run it: every console block, in order.

A fresh checkout (tests/checkout.py) with no instance folder and nothing
exported; one bash session keeps the guide's shell variables from block to
block. Each ``console`` block is a transcript: ``$ `` starts a command
(continued by a trailing backslash, or by ``> `` lines of a here-document),
and the lines up to the next command are its expected output. An expected
line of ``...`` stands for any lines, ``...`` inside a line for any text;
timestamps and pids may differ. ``make run`` and ``python3 bin/sink.py``
keep running, as in their own terminals: they are started in the
background, and their expected output is checked at the end, once all the
guide has been run. Ports 8000 and 9000 are swapped for free ones.

The "Brokers" section's tour runs against the real RabbitMQ and NATS
(``TEST_RABBITMQ_URL``, ``TEST_NATS_URL``; the README's own URLs are the
defaults), with its queue, stream and subject names made unique to the
run and deleted afterwards; a command that reads what a background
process stored (``/metrics``) is run again until it shows it, as a reader
would look again. Without the brokers the tour is left out, except in CI.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import pika
import pytest
import requests

from .checkout import bare_env, fresh_checkout
from .conftest import CI
from .servers import ROOT, free_port, stop, wait_until

README = ROOT / "README.md"
LONG_RUNNING = ("make run", "python3 bin/sink.py")
# Commands that read what a background process does, run again until their
# output matches.
EVENTUAL = ("/metrics",)
BROKERS = "Brokers"
RABBIT_URL = os.environ.get("TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
NATS_URL = os.environ.get("TEST_NATS_URL", "nats://127.0.0.1:4222")
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")
_PID = re.compile(r"\b(pid|kill) \d+")


@dataclass
class Command:
    text: str
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    heading: str
    commands: list[Command]


def console_blocks(markdown: str) -> list[Block]:
    """The ``console`` blocks of a Markdown text, each with the heading it is under."""
    blocks: list[Block] = []
    heading = ""
    lines = iter(markdown.splitlines())
    for line in lines:
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.strip() != "```console":
            continue
        body = []
        for inner in lines:
            if inner.strip() == "```":
                break
            body.append(inner)
        blocks.append(Block(heading, _commands(body)))
    return blocks


def _commands(lines: list[str]) -> list[Command]:
    commands: list[Command] = []
    continued = False
    for line in lines:
        if line.startswith("$ "):
            commands.append(Command(line[2:]))
        elif continued or line.startswith("> "):
            commands[-1].text += "\n" + (line[2:] if line.startswith("> ") else line)
        else:
            commands[-1].expected.append(line)
            continue
        continued = line.endswith("\\")
    return commands


def _normal(line: str) -> str:
    return _PID.sub(r"\1 N", _TIME.sub("TIME", line.rstrip("\r")))


def matches(expected: list[str], actual: list[str]) -> bool:
    """Tell whether output lines match a transcript's lines (``...`` wildcards)."""
    pattern = ""
    for line in expected:
        if line == "...":
            pattern += r"(?:[^\n]*\n)*?"
        else:
            parts = [re.escape(p) for p in _normal(line).split("...")]
            pattern += ".*?".join(parts) + r"\n"
    text = "".join(_normal(line) + "\n" for line in actual)
    return re.fullmatch(pattern, text) is not None


class Shell:
    """One bash session, fed commands one at a time, as a terminal is."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            ["bash", "--norc", "--noprofile"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.count = 0

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))

    def run(self, command: str, timeout: float = 120) -> tuple[list[str], int]:
        """Run one command; its output lines and exit status."""
        self.count += 1
        marker = f"__readme_done_{self.count}__"
        assert self.process.stdin is not None
        self.process.stdin.write(f"{command}\nprintf '\\n{marker} %s\\n' $?\n")
        self.process.stdin.flush()
        output: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line.startswith(marker):
                if output and output[-1] == "":
                    output.pop()  # the newline printf put before the marker
                return output, int(line.split()[-1])
            output.append(line)

    def close(self) -> None:
        stop(self.process)  # type: ignore[arg-type]
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


@dataclass
class Background:
    command: Command
    process: subprocess.Popen[bytes]
    log: Path


@pytest.mark.slow
def test_the_readme_guide_runs_as_written_on_a_fresh_checkout(tmp_path):
    blocks = console_blocks(README.read_text())
    headings = {block.heading for block in blocks}
    for section in ("Quick start", "Receive your first webhook", "Forward it to your service"):
        assert section in headings
    commands = [command for block in blocks for command in block.commands]
    texts = "\n".join(c.text for c in commands)
    for needed in (
        "flask --app wsgi purge",
        "flask --app wsgi worker --drain",
        "make stop",
        "flask --app wsgi brokers declare",
        "flask --app wsgi brokers publish",
    ):
        assert needed in texts
    assert any(block.heading == BROKERS and block.commands for block in blocks)
    if not _brokers_up():
        if CI:
            pytest.fail(
                "RabbitMQ or NATS JetStream is not reachable (CI: the broker tour must run)"
            )
        print("\nRabbitMQ or NATS JetStream is not reachable: the broker tour is left out")
        blocks = [block for block in blocks if block.heading != BROKERS]
        commands = [command for block in blocks for command in block.commands]

    root = fresh_checkout(tmp_path)
    web, sink = free_port(), free_port()
    tag = uuid.uuid4().hex[:8]

    def local(text: str) -> str:
        text = text.replace("127.0.0.1:8000", f"127.0.0.1:{web}")
        text = text.replace("127.0.0.1:9000", f"127.0.0.1:{sink}")
        text = text.replace("bin/sink.py 9000", f"bin/sink.py {sink}")
        text = text.replace("amqp://guest:guest@127.0.0.1:5672/%2F", RABBIT_URL)
        text = text.replace("nats://127.0.0.1:4222", NATS_URL)
        # The broker tour's names, unique to this run (the brokers are shared).
        text = re.sub(r"\borders\b", f"orders-{tag}", text)
        text = re.sub(r"\bpayments\b", f"payments-{tag}", text)
        text = re.sub(r"\bPAYMENTS", f"PAYMENTS_{tag.upper()}", text)
        return re.sub(r"^make run$", f"make run BIND=127.0.0.1:{web}", text)

    env = bare_env()
    shell = Shell(root, env)
    background: list[Background] = []
    started = time.monotonic()
    try:
        for n, command in enumerate(commands):
            text = local(command.text)
            expected = [local(line) for line in command.expected]
            if text.startswith("export "):
                name, _, value = text[len("export ") :].partition("=")
                env[name] = value.strip("'\"")
            if text.startswith(LONG_RUNNING):
                log = tmp_path / f"background-{n}.log"
                with open(log, "wb") as out:
                    process = subprocess.Popen(
                        ["bash", "-c", f"exec {text}"],
                        cwd=root,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                background.append(Background(Command(text, expected), process, log))
                _wait_started(text, process, log, web)
                continue
            if "--drain" in text:
                # A drain counts what no worker has taken yet: first let the running
                # worker deliver what the guide sent (the sink shows it), as a reader
                # who watched the sink's terminal would have.
                for item in background:
                    wait_until(
                        lambda item=item: matches(item.command.expected, _lines(item.log)),
                        timeout=30,
                    )
            output, status = shell.run(text)
            deadline = time.monotonic() + 30
            while any(part in text for part in EVENTUAL) and time.monotonic() < deadline:
                if status == 0 and matches(expected, output):
                    break
                time.sleep(0.5)
                output, status = shell.run(text)
            assert status == 0, (text, output)
            assert matches(expected, output), "\n".join(
                ["$ " + text, "expected:", *expected, "got:", *output]
            )
        elapsed = time.monotonic() - started
        # What kept running, as in its own terminal, printed what the guide says.
        for item in background:
            assert wait_until(
                lambda item=item: matches(item.command.expected, _lines(item.log)), timeout=30
            ), "\n".join(
                ["$ " + item.command.text, "expected:", *item.command.expected, "got:"]
                + _lines(item.log)
            )
        # make stop stopped every make run; nothing of them is left.
        for item in background:
            if item.command.text.startswith("make run"):
                assert item.process.wait(timeout=60) == 0
        print(f"\nthe README's guide ran in {elapsed:.1f} s (virtualenv already installed)")
    finally:
        shell.close()
        for item in background:
            if item.process.poll() is None:
                os.killpg(item.process.pid, signal.SIGTERM)
                item.process.wait(timeout=60)
        _delete_tour_brokers(local)


def _brokers_up() -> bool:
    async def jetstream() -> None:
        nc = await nats.connect(NATS_URL, connect_timeout=2, max_reconnect_attempts=1)
        try:
            await nc.jetstream().account_info()
        finally:
            await nc.close()

    try:
        pika.BlockingConnection(pika.URLParameters(RABBIT_URL)).close()
        asyncio.run(jetstream())
    except Exception:
        return False
    return True


def _delete_tour_brokers(local: Any) -> None:
    """Delete what the tour's `brokers declare` made, under this run's names."""
    try:
        connection = pika.BlockingConnection(pika.URLParameters(RABBIT_URL))
    except Exception:
        return
    try:
        channel = connection.channel()
        for name in ("orders", "orders.dead"):
            channel.queue_delete(local(name))
        channel.exchange_delete(local("orders.dlx"))
    finally:
        connection.close()

    async def streams() -> None:
        nc = await nats.connect(NATS_URL, connect_timeout=2, max_reconnect_attempts=1)
        try:
            js = nc.jetstream()
            for name in ("PAYMENTS", "PAYMENTS_DEAD"):
                try:
                    await js.delete_stream(local(name))
                except nats.js.errors.NotFoundError:
                    pass
        finally:
            await nc.close()

    try:
        asyncio.run(streams())
    except Exception:
        pass


def _lines(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines()


def _wait_started(text: str, process: subprocess.Popen[bytes], log: Path, web: int) -> None:
    def up() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"{text} exited:\n{log.read_text()}")
        if text.startswith("make run"):
            if "is running as pid" not in log.read_text():
                return False
            try:
                return requests.get(f"http://127.0.0.1:{web}/healthz", timeout=1).ok
            except requests.RequestException:
                return False
        return "listening on" in log.read_text()

    assert wait_until(up, timeout=120), log.read_text()


def test_the_transcript_matcher():
    assert matches(["a", "...", "c"], ["a", "b", "b", "c"])
    assert matches(["a", "...", "c"], ["a", "c"])
    assert matches(["x ... z"], ["x y z"])
    assert not matches(["a", "c"], ["a", "b", "c"])
    assert matches(["pid 1 at 2026-01-01T00:00:00Z"], ["pid 99 at 2027-02-03T04:05:06.7Z"])
    blocks = console_blocks("# H\n```console\n$ a \\\n  b\nout\n$ cat <<E\n> x\n> E\nx\n```\n")
    assert [(c.text, c.expected) for c in blocks[0].commands] == [
        ("a \\\n  b", ["out"]),
        ("cat <<E\nx\nE", ["x"]),
    ]
