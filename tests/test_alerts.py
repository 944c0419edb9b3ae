"""The Prometheus alert rules in deploy/prometheus: checked and unit-tested by promtool.

``promtool test rules`` feeds each rule series and checks what fires and
what does not (deploy/prometheus/alerts.test.yml). The rules' metric names
are checked against a real scrape, so a renamed metric cannot leave a rule
silently watching nothing. promtool is Debian's ``prometheus`` package;
without it the tests skip locally and fail in CI.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families

from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery, Event, utcnow

from .helpers import event_row, unavailable
from .servers import ROOT

RULES = ROOT / "deploy" / "prometheus"


@pytest.fixture
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        unavailable("promtool is missing (apt-get install prometheus)")
    return path


def _promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], cwd=RULES, capture_output=True, text=True, timeout=120)


def test_the_alert_rules_are_valid(promtool):
    result = _promtool(promtool, "check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_alert_fires_when_it_should_and_only_then(promtool):
    result = _promtool(promtool, "test", "rules", "alerts.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", (RULES / "alerts.test.yml").read_text()))
    defined = set(re.findall(r"- alert: (\w+)", (RULES / "alerts.yml").read_text()))
    assert tested == defined


def test_the_rules_watch_metrics_the_receiver_exposes(client):
    exposed = {
        sample_or_family
        for family in text_string_to_metric_families(client.get("/metrics").get_data(as_text=True))
        for sample_or_family in (family.name, f"{family.name}_total")
    }
    watched = set(re.findall(r"webhook_receiver_\w+", (RULES / "alerts.yml").read_text()))
    assert watched
    assert watched <= exposed, watched - exposed


def _pending(app, *, due_in: timedelta) -> None:
    now = utcnow()
    with app.app_context():
        event = Event(
            **event_row(source="stripe", dedup_key=f"evt-{due_in.total_seconds()}", received_at=now)
        )
        db.session.add(event)
        db.session.flush()
        db.session.add(
            Delivery(
                event_id=event.id,
                consumer="billing",
                kind="forward",
                state="pending",
                next_attempt_at=now + due_in,
                created_at=now,
                updated_at=now,
            )
        )
        db.session.commit()


def _gauges(client) -> dict[str, float]:
    text = client.get("/metrics").get_data(as_text=True)
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.endswith(("deliveries_due", "oldest_due_delivery_seconds"))
    }


def test_deliveries_waiting_for_a_worker_are_exposed_for_their_alert(app, client):
    assert _gauges(client) == {
        "webhook_receiver_deliveries_due": 0,
        "webhook_receiver_oldest_due_delivery_seconds": 0,
    }
    _pending(app, due_in=timedelta(minutes=-10))
    _pending(app, due_in=timedelta(minutes=-1))
    _pending(app, due_in=timedelta(minutes=5))  # backing off: not waiting for a worker
    gauges = _gauges(client)
    assert gauges["webhook_receiver_deliveries_due"] == 2
    assert 600 <= gauges["webhook_receiver_oldest_due_delivery_seconds"] < 3600
