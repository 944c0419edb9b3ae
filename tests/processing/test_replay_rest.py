"""A replay's process that rests between batches keeps its replay: no other worker takes it over.

The rest after a batch (``rest`` times as long as the batch took) could
outlast the replay's lease, which only a batch renewed: a running worker
then took the replay over as if its process had died, and the process,
still running, stopped at its next batch ("taken over by another
process") and reported only what it had queued itself.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta

from webhook_receiver.outbox.replays import Filter
from webhook_receiver.processing import replay

from ..servers import wait_until
from .conftest import FAST, config_with, forward
from .test_outcome_outage import _Outage
from .test_replay import _delivered, _key_replays, keys, replays


def _now() -> datetime:
    return datetime.now(UTC)


def test_a_replay_resting_longer_than_its_lease_is_not_taken_over(
    make_app, downstream, make_worker, db_url, monkeypatch, caplog
):
    monkeypatch.setattr(replay, "LEASE", timedelta(seconds=1.5))
    app = make_app(config_with([forward("billing", downstream.url + "/billing")]), **FAST)
    _delivered(app, _now, 15)
    # A second worker, running, on the same clock as the replay's process.
    worker = make_worker(app, _now)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    thread.start()
    outage = _Outage(db_url, tables="replays")
    try:
        with caplog.at_level(logging.INFO, logger="webhook_receiver"), app.app_context():
            plan = replay.preview(Filter(consumer="billing"))
            held = replay.start(plan, actor="cli", via="cli", rest=8.0)
            # The first batch's write waits 0.6 s for the table: a rest of
            # about 5 s follows, three leases.
            outage.begin()
            threading.Timer(0.6, outage.end).start()
            progress = replay.resume(held, batch_size=10)
    finally:
        outage.end()
        try:
            assert wait_until(lambda: len(downstream.calls_to("/billing")) >= 15, timeout=30)
        finally:
            worker.stop()
            thread.join(30)
    assert not thread.is_alive()
    assert progress.finished, "taken over while it rested"
    assert sum(progress.consumers.values()) == 15
    assert not any("by this worker" in r.getMessage() for r in caplog.records)
    [record] = replays(app)
    assert (record.walked, record.replayed) == (15, 15)
    assert _key_replays(app) == {0: 15}
    assert set(Counter(keys(downstream, "/billing")).values()) == {1}
