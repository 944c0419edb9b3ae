"""Outages as an operator reads them: JSON lines, one per attempt, each cause timed on its own."""

from __future__ import annotations

import json
import logging
import time

from webhook_receiver.brokers.outage import Outage

from ..servers import free_port
from .conftest import start_consume, stop, wait_until


def test_a_broker_that_refuses_gives_one_json_line_per_reconnect_attempt(db_url, tmp_path):
    # pika says a refused connection seven times (one with a traceback) as
    # plain text between the JSON lines; the consumer says it once per attempt.
    config = (
        "[sources.orders]\n"
        'provider = "rabbitmq"\n'
        f'url = "amqp://guest:guest@127.0.0.1:{free_port()}/%2F"\n'
        'queue = "orders"\n'
    )
    process, log_path = start_consume(
        db_url, config, tmp_path, env={"WEBHOOK_RECEIVER_LOG_FORMAT": "json"}
    )
    try:
        assert wait_until(lambda: log_path.read_text().count("still unavailable") >= 2, 30)
    finally:
        stop(process)
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    # Every line is JSON (no plain text, no traceback) but the command's own last word.
    assert lines.pop() == "consume stopped (orders)"
    records = [json.loads(line) for line in lines]
    attempts = [r for r in records if r.get("source") == "orders" and r.get("outage") == "broker"]
    assert attempts[0]["message"].startswith("source orders: broker unavailable")
    assert "Connection refused" in attempts[0]["message"]
    assert all(r["level"] == "WARNING" for r in attempts)
    # Nothing else at WARNING or above: pika's narration of each attempt is left out.
    others = [r for r in records if r not in attempts and r["level"] in ("WARNING", "ERROR")]
    assert others == []
    assert not any("Traceback" in line for line in lines)


def test_each_cause_of_outage_is_timed_on_its_own(caplog):
    caplog.set_level(logging.INFO, logger="webhook_receiver.brokers")
    broker, database = Outage("orders", "broker"), Outage("orders", "database")
    broker.failed("connection lost")
    time.sleep(0.3)
    database.failed("locked")
    database.recovered()  # a batch stored: the database is back, the broker is not
    assert "broker back" not in caplog.text
    time.sleep(0.3)
    broker.recovered()
    ends = {r.outage: r.getMessage() for r in caplog.records if "back after" in r.getMessage()}
    assert set(ends) == {"broker", "database"}
    seconds = float(ends["broker"].split("back after ")[1].split(" s")[0])
    assert seconds >= 0.6  # the outage's true length, not the time since the database's end
    assert float(ends["database"].split("back after ")[1].split(" s")[0]) < 0.3
