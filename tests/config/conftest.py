"""Apps that read their TOML file, environment and instance folder for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from flask import Flask

from webhook_receiver import create_app
from webhook_receiver.extensions import db


@pytest.fixture
def instance(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Give apps built here an instance folder of the test's own, not the checkout's."""
    path = tmp_path / "instance"
    monkeypatch.setattr(Flask, "auto_find_instance_path", lambda self: str(path))
    return path


def build(**config) -> Flask:
    """An app that reads its TOML file and environment for real (no RECEIVER_CONFIG)."""
    return create_app({"TESTING": True, **config})


def dispose(app: Flask) -> None:
    with app.app_context():
        db.session.remove()
        db.engine.dispose()


ROOT = Path(__file__).resolve().parents[2]


def flask_consume_list(**env: str) -> subprocess.CompletedProcess[str]:
    """Run ``flask consume --list`` in the checkout, its WEBHOOK_RECEIVER_* environment ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WEBHOOK_RECEIVER_")}
    return subprocess.run(
        [sys.executable, "-m", "flask", "--app", "wsgi", "consume", "--list"],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
