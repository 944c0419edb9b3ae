"""``flask brokers declare`` and ``publish`` for Pub/Sub and SQS: what an operator meets."""

from __future__ import annotations

import pytest

SOURCE = "jobs"


def _one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.mark.parametrize("command", [("declare",), ("publish", SOURCE, "{}")])
def test_pubsub_without_credentials_is_one_line(make_app, tmp_path, monkeypatch, command):
    # No emulator, and Google's client finds no credentials: the real
    # client, as an operator without `gcloud auth application-default login` meets it.
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    table = {"provider": "pubsub", "project": "my-project", "subscription": "jobs-receiver"}
    app = make_app({"sources": {SOURCE: table}})
    result = app.test_cli_runner().invoke(args=["brokers", *command])
    error = _one_line_error(result)
    assert error.startswith(f"Error: source {SOURCE}: Pub/Sub: no credentials: ")
    assert "missing.json was not found" in error
