"""The delivery worker through a database it cannot write: it waits, warns and retries."""

from __future__ import annotations

import logging
import threading
import time

from ..databases import read_only
from .conftest import FAST, config_with, delivery, forward, store_event


def test_worker_waits_out_a_read_only_database_with_a_warning_not_an_error(
    make_app, db_url, downstream, clock, make_worker, caplog
):
    # A standby after a failover refuses writes: PostgreSQL with
    # read_only_sql_transaction (an InternalError, not an OperationalError),
    # SQLite with a read-only file. The worker must treat both as the
    # database being away (a warning, then a retry), not as a bug (an ERROR
    # with a traceback, paged on), and must call nobody meanwhile.
    config = config_with([forward("billing", downstream.url + "/billing")])
    writable = make_app(config, **FAST)
    event_id = store_event(writable, clock, dedup_key="evt-standby")
    standby = make_app(config, **FAST, **read_only(db_url))
    worker = make_worker(standby, clock)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    with caplog.at_level(logging.INFO, logger="webhook_receiver"):
        thread.start()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not any(
            "database unavailable" in r.getMessage() for r in caplog.records
        ):
            time.sleep(0.05)
        worker.stop()
        thread.join(15)
    assert not thread.is_alive()
    worker_lines = [r for r in caplog.records if r.name.startswith("webhook_receiver.processing")]
    warnings = [r for r in worker_lines if "database unavailable" in r.getMessage()]
    assert warnings, [r.getMessage() for r in worker_lines]
    assert all(r.levelno == logging.WARNING and not r.exc_info for r in warnings)
    assert not [r for r in worker_lines if r.levelno >= logging.ERROR]
    assert downstream.calls == []
    row = delivery(writable, event_id, "billing")
    assert (row["state"], row["attempts"]) == ("pending", 0)
