"""Start-up checks across settings: the secret key, and retention against redeliveries."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from .loader import FileConfig
from .settings import DEV_SECRET_KEY, MIN_RETENTION_DAYS, ConfigError

SECRET_KEY_FILE = "secret_key"
_MAKE_A_KEY = "python -c 'import secrets; print(secrets.token_hex(32))'"


def check_secret_key(
    settings: MutableMapping[str, Any], instance_path: str, *, lenient: bool
) -> None:
    """Settle ``SECRET_KEY`` in place, or refuse a weak one, or a missing one the admin needs.

    ``lenient`` (debugging or testing) puts a development key in for none.
    """
    # Every entry point (gunicorn, each flask command, tests) finds the key
    # the same way: SECRET_KEY given, else the instance folder's secret_key
    # file, which `make run` writes.
    key = settings.get("SECRET_KEY") or _read_key_file(instance_path)
    if lenient:
        settings["SECRET_KEY"] = key or DEV_SECRET_KEY
        return
    if key and (key == DEV_SECRET_KEY or len(str(key)) < 16):
        raise ConfigError(
            f"SECRET_KEY is too short or a placeholder: set a long random value ({_MAKE_A_KEY})"
        )
    if not key and settings.get("ADMIN_PASSWORD"):
        # Only the admin signs anything (its session cookie and CSRF tokens):
        # the receiver, the worker and purge run without a key.
        path = os.path.join(instance_path, SECRET_KEY_FILE)
        raise ConfigError(
            "SECRET_KEY is missing and the admin needs it to sign its sessions: "
            f"run `make instance/secret_key` (make run does), or write one to {path}, "
            f"or set SECRET_KEY ({_MAKE_A_KEY})"
        )
    settings["SECRET_KEY"] = key or None


def _read_key_file(instance_path: str) -> str | None:
    path = os.path.join(instance_path, SECRET_KEY_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            key = fh.read().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read: {exc}") from exc
    if not key:
        raise ConfigError(f"{path} is empty: delete it and run `make instance/secret_key`")
    return key


def check_retention(settings: Mapping[str, Any], file_config: FileConfig) -> None:
    """Refuse retention that would purge what a replay or a redelivery still needs."""
    api_seconds = settings["API_RETENTION_DAYS"] * 86400
    if api_seconds < settings["IDEMPOTENCY_TTL_SECONDS"]:
        # A replay would then answer with the id of an event already purged.
        raise ConfigError(
            "WEBHOOK_RECEIVER_API_RETENTION_DAYS is shorter than "
            "WEBHOOK_RECEIVER_IDEMPOTENCY_TTL_SECONDS: API events must outlive their keys"
        )
    if settings["IDEMPOTENCY_TTL_SECONDS"] < settings["IDEMPOTENCY_LEASE_SECONDS"]:
        # A request still running would hold an expired key: another request
        # could take it over, and the purge delete it, claim and all.
        raise ConfigError(
            "WEBHOOK_RECEIVER_IDEMPOTENCY_TTL_SECONDS is shorter than "
            "WEBHOOK_RECEIVER_IDEMPOTENCY_LEASE_SECONDS: a key must outlive the request it holds"
        )
    if settings["FORCE_SHORT_RETENTION"]:
        return
    for name, days in file_config.retention_days().items():
        if days < MIN_RETENTION_DAYS:
            raise ConfigError(
                f"{file_config.path}: [sources.{name}] retention_days = "
                f"{days} is shorter than providers' redelivery window "
                f"({MIN_RETENTION_DAYS} days): duplicates would be accepted again. "
                "Set WEBHOOK_RECEIVER_FORCE_SHORT_RETENTION=true to force it."
            )
