"""The configuration file: found, read and refused with its path; the example that the docs give."""

from __future__ import annotations

import subprocess

import pytest

from webhook_receiver import config as cfg
from webhook_receiver.webhooks.providers import PROVIDERS

from ..conftest import ACME_TOKEN
from ..helpers.signing import hmac_hex
from ..servers import BIN, ROOT, app_env
from .conftest import build, dispose

GOOD_TOML = f'[clients.acme]\ntoken = "{ACME_TOKEN}"\n'


# -- the TOML file ------------------------------------------------------------


def test_malformed_toml_names_the_file_and_the_problem(instance, tmp_path, monkeypatch):
    path = tmp_path / "broken.toml"
    path.write_text('[clients.acme\ntoken = "x"\n')
    monkeypatch.setenv("WEBHOOK_RECEIVER_CONFIG", str(path))
    with pytest.raises(cfg.ConfigError) as info:
        build()
    message = str(info.value)
    assert str(path) in message
    assert "not valid TOML" in message
    assert "line 1" in message


def test_malformed_toml_stops_the_flask_cli_with_the_message(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('[clients.acme]\ntoken = "unterminated\n')
    db_path = tmp_path / "app.sqlite3"
    result = subprocess.run(
        [str(BIN / "flask"), "--app", "wsgi", "routes"],
        cwd=ROOT,
        env=app_env(f"sqlite:///{db_path}", path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    # One line naming the file and the problem, no traceback.
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("Error: ")
    assert str(path) in result.stderr
    assert "not valid TOML" in result.stderr
    assert "/api/events" not in result.stdout  # no routes listed: it never started


def test_the_flask_cli_starts_with_a_good_file(tmp_path):
    path = tmp_path / "good.toml"
    path.write_text(GOOD_TOML)
    result = subprocess.run(
        [str(BIN / "flask"), "--app", "wsgi", "routes"],
        cwd=ROOT,
        env=app_env(f"sqlite:///{tmp_path / 'app.sqlite3'}", path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "/api/events" in result.stdout
    assert "/readyz" in result.stdout


def test_explicit_config_path_that_does_not_exist_is_an_error(instance, tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / "config.toml"
    monkeypatch.setenv("WEBHOOK_RECEIVER_CONFIG", str(missing))
    with pytest.raises(cfg.ConfigError, match="config file not found") as info:
        build()
    assert str(missing) in str(info.value)


def test_default_config_file_missing_is_an_empty_config(instance):
    app = build()
    file_config = app.config["FILE_CONFIG"]
    assert file_config.path == str(instance / "config.toml")
    assert file_config.clients == {}
    assert file_config.sources == {}
    dispose(app)


def test_default_config_file_in_the_instance_folder_is_read(instance):
    instance.mkdir()
    (instance / "config.toml").write_text(GOOD_TOML)
    app = build()
    client = app.config["FILE_CONFIG"].client_for_token(ACME_TOKEN)
    assert client is not None and client.name == "acme"
    dispose(app)


def test_config_file_from_the_environment_is_used(instance, tmp_path, monkeypatch):
    path = tmp_path / "receiver.toml"
    path.write_text(GOOD_TOML)
    monkeypatch.setenv("WEBHOOK_RECEIVER_CONFIG", str(path))
    app = build()
    assert app.config["FILE_CONFIG"].path == str(path)
    assert set(app.config["FILE_CONFIG"].clients) == {"acme"}
    dispose(app)


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('[clients.acme]\ntoken = "short"\n', r"\[clients.acme\] token must be a string of 16\+"),
        ("[clients.acme]\ntoken = 12345678901234567890\n", r"token must be a string"),
        ("[clients.acme]\n", r"token must be a string"),
        (
            f'[clients.a]\ntoken = "{ACME_TOKEN}"\n[clients.b]\ntoken = "{ACME_TOKEN}"\n',
            "two clients share one token",
        ),
        (
            f'[clients.acme]\ntoken = "{ACME_TOKEN}"\nscopes = ["all"]\n',
            r"\[clients.acme\] unknown key\(s\): scopes",
        ),
        (f'[client.acme]\ntoken = "{ACME_TOKEN}"\n', r"unknown top-level key\(s\): client"),
        ('clients = "acme"\n', r"\[clients\] must hold tables"),
        (
            '[sources.shop]\nprovider = "paypal"\nsecrets = ["s3cret"]\n',
            r"\[sources.shop\] provider must be one of",
        ),
        ("[sources.shop]\n", r"\[sources.shop\] provider must be one of"),
        ('[sources.shop]\nprovider = "github"\n', r"\[sources.shop\] secrets must be"),
        ('handlers = "mymodule"\n', "handlers must be a list"),
        (
            '[sources.shop]\nprovider = "github"\nsecrets = ["s"]\ntolerence_seconds = 60\n',
            r"\[sources.shop\] unknown key\(s\) for provider github: tolerence_seconds",
        ),
        (
            '[sources.shop]\nprovider = "stripe"\nsecrets = ["s"]\nevent_type = "json:/t"\n',
            r"\[sources.shop\] unknown key\(s\) for provider stripe: event_type",
        ),
        (
            '[sources.shop]\nprovider = "github"\nsecrets = ["s"]\n'
            '[[sources.shop.forward]]\nname = "f"\nurl = "http://x"\ntimout_seconds = 1\n',
            r"\[\[sources.shop.forward\]\] f: unknown key\(s\): timout_seconds",
        ),
    ],
    ids=[
        "short-token",
        "non-string-token",
        "missing-token",
        "duplicate-token",
        "unknown-client-key",
        "unknown-top-level-key",
        "clients-not-tables",
        "bad-provider",
        "missing-provider",
        "missing-secrets",
        "handlers-not-a-list",
        "unknown-source-key",
        "key-of-another-provider",
        "unknown-forward-key",
    ],
)
def test_invalid_config_file_is_refused_with_its_path(
    instance, tmp_path, monkeypatch, toml, expected
):
    path = tmp_path / "receiver.toml"
    path.write_text(toml)
    monkeypatch.setenv("WEBHOOK_RECEIVER_CONFIG", str(path))
    with pytest.raises(cfg.ConfigError, match=expected) as info:
        build()
    assert str(info.value).startswith(f"{path}: ")


def test_token_lookup_finds_only_exact_tokens():
    file_config = cfg.parse({"clients": {"acme": {"token": ACME_TOKEN}}}, providers=PROVIDERS)
    assert file_config.client_for_token(ACME_TOKEN).name == "acme"
    assert file_config.client_for_token(ACME_TOKEN[:-1]) is None
    assert file_config.client_for_token(ACME_TOKEN + " ") is None
    assert file_config.client_for_token("") is None
    assert ACME_TOKEN not in repr(file_config)


def test_the_example_config_works_as_documented(make_app):
    """docs/config.example.toml parses, and its demo source takes the documented delivery."""
    import tomllib
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "config.example.toml"
    app = make_app(tomllib.loads(path.read_text()))
    body = b'{"id": "evt-1", "type": "demo"}'
    sig = hmac_hex(body, "demo-secret-change-me")
    headers = {"Content-Type": "application/json", "X-Signature": f"sha256={sig}"}
    response = app.test_client().post("/webhooks/demo", data=body, headers=headers)
    assert response.status_code == 200, response.get_data()
    assert response.get_json()["status"] == "accepted"
