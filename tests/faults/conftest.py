"""Fixtures of the fault suite: a PostgreSQL server the test may stop."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..conftest import CI, _migrate
from ..databases import PG_URL, _sa_url
from .postgres import BlockedDatabase, PrivatePostgres, find_bin_dir, private_postgres


@pytest.fixture
def stoppable_postgres() -> Iterator[PrivatePostgres | BlockedDatabase]:
    """A migrated PostgreSQL database of this test's own, with ``stop`` and ``start``.

    A private cluster when this machine has ``initdb``; otherwise, outside CI,
    a throwaway database on the shared server whose connections are cut off.
    In CI a missing ``initdb`` fails the test: the outage must really be staged.
    """
    bin_dir = find_bin_dir()
    server: PrivatePostgres | BlockedDatabase
    if bin_dir is not None:
        server = private_postgres(bin_dir)
    elif CI:
        pytest.fail("initdb not found (set PG_BIN): CI must stage a real PostgreSQL outage")
    elif PG_URL:
        server = BlockedDatabase(_sa_url(PG_URL))
    else:
        pytest.skip("neither initdb nor TEST_DATABASE_URL: no PostgreSQL to stop")
    try:
        server.init()
        _migrate(server.url)
        yield server
    finally:
        server.destroy()
