"""Throwaway databases for tests that must own theirs (outages, downgrades), and read-only ones."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

from webhook_receiver.config import database_uri

PG_URL = os.environ.get("TEST_DATABASE_URL")


def _sa_url(url: str) -> str:
    """The SQLAlchemy URL of a postgres:// or postgresql:// URL (psycopg 3)."""
    return database_uri(url, "")


@contextmanager
def throwaway_postgresql(prefix: str) -> Iterator[tuple[str, Engine, str]]:
    """Create an empty PostgreSQL database; yield its URL, an admin engine and its name.

    The database lives on the shared test server, and is dropped (with any
    connections left to it) when the block ends.
    """
    if not PG_URL:
        pytest.skip("TEST_DATABASE_URL is not set")
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(_sa_url(PG_URL), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(_sa_url(PG_URL)).set(database=name).render_as_string(hide_password=False)
    try:
        yield url, admin, name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def read_only(db_url: str) -> dict[str, Any]:
    """App settings that open this test's database read-only."""
    if db_url.startswith("sqlite:///"):
        path = db_url.removeprefix("sqlite:///")
        return {"SQLALCHEMY_DATABASE_URI": f"sqlite:///file:{path}?mode=ro&uri=true"}
    return {
        "SQLALCHEMY_ENGINE_OPTIONS": {
            "connect_args": {"connect_timeout": 5, "options": "-c default_transaction_read_only=on"}
        }
    }
