"""A fresh checkout of the project for a test: a clean instance folder, nothing exported.

The checkout's files are symlinks to this one's (``.venv`` included), except
``wsgi.py``, which is copied: the flask CLI resolves the app's file before
it imports it, and a copy makes it import the package through the
checkout, whose instance folder is therefore the checkout's own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .servers import ROOT

LINKED = (
    "webhook_receiver",
    "migrations",
    "docs",
    "deploy",
    "bin",
    "Makefile",
    "pyproject.toml",
    "gunicorn.conf.py",
    ".venv",
)


def fresh_checkout(tmp_path: Path) -> Path:
    """Lay out a checkout without an instance folder under ``tmp_path``."""
    root = tmp_path / "checkout"
    root.mkdir()
    for name in LINKED:
        if (ROOT / name).exists():
            (root / name).symlink_to(ROOT / name)
    shutil.copyfile(ROOT / "wsgi.py", root / "wsgi.py")
    return root


def bare_env(**extra: str) -> dict[str, str]:
    """A newcomer's shell: PATH, HOME and locale, nothing about this project exported."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TZ")}
    env.update(extra)
    return env


def run(root: Path, command: str, env: dict[str, str] | None = None, timeout: float = 120) -> Any:
    """Run a shell command in the checkout as a newcomer would; stdout and stderr together."""
    return subprocess.run(
        ["bash", "-c", command],
        cwd=root,
        env=env if env is not None else bare_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
