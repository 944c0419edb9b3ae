"""Apps that read their TOML file, environment and instance folder for real."""

from __future__ import annotations

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
