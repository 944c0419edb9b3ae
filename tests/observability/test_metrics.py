"""Prometheus metrics: the counts, ``/metrics`` and its token, and multiprocess mode."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event

from webhook_receiver.extensions import db
from webhook_receiver.observability import metrics

from ..conftest import CLIENTS, bearer
from ..helpers import signing as s
from ..helpers import unavailable
from ..processing.conftest import SOURCE, Reply, config_with, drain, forward, store_event
from ..servers import BIN, ROOT, app_env, gunicorn, wait_until, worker_pids

CONFIG = {"sources": {"stripe-live": s.SOURCES["stripe-live"]}, "clients": CLIENTS}


@pytest.fixture
def app(make_app):
    return make_app(CONFIG)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Parse the exposition text into {(sample name, labels): value}."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(parsed, name: str, **labels: str) -> float:
    return parsed.get((name, frozenset(labels.items())), 0.0)


def stripe(client_or_url, event_id: str, payload: dict | None = None, **sign):
    body, headers = s.stripe_delivery(
        {"id": event_id, "type": "invoice.paid", "data": payload or {}}, **sign
    )
    if isinstance(client_or_url, str):
        return requests.post(client_or_url, data=body, headers=headers, timeout=30)
    return client_or_url.post("/webhooks/stripe-live", data=body, headers=headers)


def api_post(client, key: str, body: dict):
    return client.post(
        "/api/events",
        data=json.dumps(body),
        content_type="application/json",
        headers={**bearer(), "Idempotency-Key": key},
    )


def test_receipts_and_api_requests_are_counted_per_source(app, client):
    for n in range(3):
        assert stripe(client, f"evt_{n}").status_code == 200
    assert stripe(client, "evt_0").status_code == 200  # duplicates
    assert stripe(client, "evt_1").status_code == 200
    assert stripe(client, "evt_2", {"changed": True}).status_code == 422  # conflict
    assert stripe(client, "evt_9", secret="whsec_wrong").status_code == 401
    assert stripe(client, "evt_9", t=int(time.time()) - 3600).status_code == 401
    order = {"type": "order.created", "data": {"n": 1}}
    assert api_post(client, "k1", order).status_code == 201
    assert api_post(client, "k1", order).headers["Idempotent-Replayed"] == "true"
    assert api_post(client, "k1", {**order, "data": 2}).status_code == 422
    assert api_post(client, "k2", {"type": ""}).status_code == 400  # stored, not received

    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    parsed = samples(response.get_data(as_text=True))
    prefix = "webhook_receiver_"
    for name, labels, expected in [
        ("received_total", {"source": "stripe-live"}, 3),
        ("duplicates_total", {"source": "stripe-live"}, 2),
        ("conflicts_total", {"source": "stripe-live"}, 1),
        ("signature_failures_total", {"source": "stripe-live", "reason": "signature"}, 1),
        ("signature_failures_total", {"source": "stripe-live", "reason": "timestamp"}, 1),
        ("received_total", {"source": "api:acme"}, 1),
        ("replays_total", {"source": "api:acme"}, 1),
        ("conflicts_total", {"source": "api:acme"}, 0),
        ("idempotency_key_reuses_total", {"source": "api:acme"}, 1),
    ]:
        assert value(parsed, prefix + name, **labels) == expected, (name, labels)
    latency = prefix + "request_duration_seconds_count"
    hook = {"endpoint": "webhooks.receive_webhook", "method": "POST"}
    assert value(parsed, latency, **hook, status="2xx") == 5
    assert value(parsed, latency, **hook, status="4xx") == 3
    assert value(parsed, latency, endpoint="api.create_event", method="POST", status="2xx") == 2


def test_latency_labels_stay_bounded(app, client):
    client.open("/webhooks/stripe-live", method="BREW")
    client.get("/no/such/page")
    parsed = samples(client.get("/metrics").get_data(as_text=True))
    count = "webhook_receiver_request_duration_seconds_count"
    # Neither routed: a 405 and a 404 have no endpoint.
    assert value(parsed, count, endpoint="unmatched", method="other", status="4xx") == 1
    assert value(parsed, count, endpoint="unmatched", method="GET", status="4xx") == 1


def test_worker_attempts_are_counted_through_the_outcome_hooks(app):
    from webhook_receiver.processing import registry
    from webhook_receiver.processing.outcomes import AttemptOutcome

    def attempt(outcome: str, n: int) -> AttemptOutcome:
        return AttemptOutcome(
            delivery_id=1,
            event_id=1,
            source="stripe-live",
            consumer="crm",
            kind="forward",
            dedup_key="evt_1",
            correlation_id=None,
            attempt=n,
            outcome=outcome,
        )

    for n, outcome in enumerate(["retry", "retry", "dead"], start=1):
        for hook in registry.get(app).outcome_hooks:
            hook(attempt(outcome, n))
    parsed = samples(app.test_client().get("/metrics").get_data(as_text=True))
    labels = {"source": "stripe-live", "consumer": "crm"}
    attempts = "webhook_receiver_delivery_attempts_total"
    assert value(parsed, attempts, **labels, outcome="retry") == 2
    assert value(parsed, attempts, **labels, outcome="dead") == 1
    assert value(parsed, "webhook_receiver_dead_letters_total", **labels) == 1


def test_counting_never_touches_the_database_and_a_scrape_reads_only_the_backlog(app, client):
    statements: list[str] = []
    with app.app_context():
        engine = db.engine
    listener = lambda *args: statements.append(args[2])  # noqa: E731
    event.listen(engine, "before_cursor_execute", listener)
    try:
        with app.test_request_context():
            metrics.received("stripe-live")
            metrics.signature_failure("stripe-live", "signature")
        assert statements == []
        assert client.get("/metrics").status_code == 200
    finally:
        event.remove(engine, "before_cursor_execute", listener)
    # A counter cannot tell that work waits; one read of the due deliveries can.
    reads = [s for s in statements if s.strip().upper() not in ("BEGIN", "ROLLBACK")]
    assert len(reads) == 1
    assert reads[0].lstrip().upper().startswith("SELECT")
    assert "deliveries" in reads[0]


def test_metrics_token_is_required_when_set(make_app):
    client = make_app(CONFIG, METRICS_TOKEN="scrape-token-0123456789").test_client()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
        response = client.get("/metrics", headers=headers)
        assert response.status_code == 401
        assert response.mimetype == "application/problem+json"
        assert response.get_json()["type"] == "/problems/unauthorized"
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    ok = client.get("/metrics", headers={"Authorization": "Bearer scrape-token-0123456789"})
    assert ok.status_code == 200
    assert b"webhook_receiver_received_total" in ok.data


GUNICORN_CONFIG = f"""
[sources.stripe-live]
provider = "stripe"
secrets = ["{s.STRIPE_SECRET}"]
"""
UNIQUE, DUPLICATES, FORGED = 24, 6, 4


@pytest.mark.slow
def test_gunicorn_workers_counts_add_up_exactly(db_url, tmp_path):
    prom = tmp_path / "prom"
    env = {"PROMETHEUS_MULTIPROC_DIR": str(prom)}
    with gunicorn(db_url, GUNICORN_CONFIG, tmp_path, workers=2, env=env) as server:
        url = f"{server.url}/webhooks/stripe-live"
        # One delivery whose body is held back keeps one worker busy, so the
        # others go to the other worker; then it completes. Both have counted.
        body, headers = s.stripe_delivery({"id": "evt_held", "type": "t", "data": {}})
        host, port = server.url.removeprefix("http://").split(":")
        held = socket.create_connection((host, int(port)))
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        held.sendall(
            f"POST /webhooks/stripe-live HTTP/1.1\r\nHost: x\r\n{head}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        )
        time.sleep(0.3)
        jobs = [(f"evt_{n}", {}) for n in range(UNIQUE - 1)]
        jobs += [(f"evt_{n}", {}) for n in range(DUPLICATES)]
        jobs += [(f"evt_x{n}", {"secret": "whsec_forged"}) for n in range(FORGED)]
        with ThreadPoolExecutor(6) as pool:
            statuses = list(pool.map(lambda job: stripe(url, job[0], **job[1]).status_code, jobs))
        assert sorted(statuses) == [200] * (UNIQUE - 1 + DUPLICATES) + [401] * FORGED
        held.sendall(body)
        assert held.makefile("rb").readline().startswith(b"HTTP/1.1 200")
        held.close()

        def scrape():
            return samples(requests.get(f"{server.url}/metrics", timeout=10).text)

        def check(parsed):
            assert value(parsed, "webhook_receiver_received_total", source="stripe-live") == UNIQUE
            duplicates = value(parsed, "webhook_receiver_duplicates_total", source="stripe-live")
            assert duplicates == DUPLICATES
            failures = value(
                parsed,
                "webhook_receiver_signature_failures_total",
                source="stripe-live",
                reason="signature",
            )
            assert failures == FORGED

        # Whichever worker answers the scrape, it reports every worker's counts.
        for _ in range(4):
            check(scrape())
        # Both workers counted (one file each), so the sum above is an aggregate.
        counters = [p for p in os.listdir(prom) if p.startswith("counter_")]
        assert len(counters) >= 2, counters

        # A killed worker's counts survive it; gunicorn replaces the worker.
        before = worker_pids(server.process.pid)
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        assert wait_until(
            lambda: len(worker_pids(server.process.pid) - {victim}) == 2, timeout=20
        ), server.log()
        check(scrape())
    assert not prom.exists() or not list(prom.glob("gauge_live*"))


def test_gunicorn_start_keeps_live_processes_files_only(tmp_path, monkeypatch):
    import runpy

    from ..servers import ROOT

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    hooks = runpy.run_path(str(ROOT / "gunicorn.conf.py"))
    dead = next(pid for pid in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{pid}"))
    for name in (f"counter_{os.getpid()}.db", f"counter_{dead}.db", f"histogram_{dead}.db"):
        (tmp_path / name).write_bytes(b"")
    hooks["on_starting"](None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"counter_{os.getpid()}.db"]
    hooks["on_exit"](None)  # a directory it did not make is left alone
    assert tmp_path.exists()


def _readme_metrics() -> set[str]:
    """The metric names of the README's table under "Metrics and alerts"."""
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Metrics and alerts", 1)[1].split("\n## ", 1)[0]
    table = section.split("| metric | labels | counts |", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"^\| `(webhook_receiver_\w+)` \|", table, re.MULTILINE))


def test_the_readme_lists_every_metric_served(app, client):
    """Every family /metrics serves is a row of the README's table, and every row is served."""
    # Labelled counters no code has counted yet are served too (their HELP
    # and TYPE lines), so nothing needs exercising to make them appear.
    response = client.get("/metrics")
    assert response.status_code == 200
    served = set(
        re.findall(r"^# TYPE (webhook_receiver_\w+) ", response.get_data(as_text=True), re.M)
    )
    # The registry's own view, in case the exposition ever leaves an empty family out.
    with app.app_context():
        registry = app.extensions[metrics.EXTENSION].registry
        collected = {
            family.name + ("_total" if family.type == "counter" else "")
            for family in registry.collect()
        }
    assert collected == served
    assert "webhook_receiver_broker_dead_letters_total" in served
    assert _readme_metrics() == served


@pytest.mark.parametrize("token", ["0", "false", "null", "[]", "1e3", "12.50"])
def test_a_metrics_token_from_the_environment_is_taken_as_written(make_app, monkeypatch, token):
    # Flask's from_prefixed_env reads each value as JSON when it can: a token
    # of "0", "false", "null" or "[]" became falsy and left /metrics open to
    # anyone, and "1e3" became 1000.0, refusing the token as written.
    monkeypatch.setenv("WEBHOOK_RECEIVER_METRICS_TOKEN", token)
    client = make_app(CONFIG).test_client()
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert ok.status_code == 200


def _raw(url: str, data: bytes) -> bytes:
    """Send bytes as they are to the server at ``url`` and read the whole answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.slow
def test_a_chunked_body_refused_before_any_view_is_timed(db_url, tmp_path):
    # problems.py reads a chunked body in the app's first before_request and
    # refuses it there (400 malformed, 413 over the limit); the timer started
    # in a later one, so these refusals never reached the latency histogram.
    env = {
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"),
        "WEBHOOK_RECEIVER_MAX_BODY_BYTES": "1024",
    }
    head = (
        b"POST /webhooks/stripe-live HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    over = b"".join(b"400\r\n" + b"x" * 1024 + b"\r\n" for _ in range(3)) + b"0\r\n\r\n"
    with gunicorn(db_url, GUNICORN_CONFIG, tmp_path, workers=1, env=env) as server:
        assert _raw(server.url, head + b"zz\r\nabc\r\n0\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert _raw(server.url, head + over).startswith(b"HTTP/1.1 413")
        parsed = samples(requests.get(f"{server.url}/metrics", timeout=10).text)
    count = "webhook_receiver_request_duration_seconds_count"
    hook = {"endpoint": "webhooks.receive_webhook", "method": "POST", "status": "4xx"}
    assert value(parsed, count, **hook) == 2


def test_a_real_workers_attempts_and_dead_letters_are_counted(
    make_app, downstream, clock, make_worker
):
    # The hooks test above calls the hooks itself; this one goes through the
    # worker, a forward and a real downstream, as production does.
    app = make_app(
        config_with(
            [
                forward("crm", f"{downstream.url}/crm", max_attempts=2),
                forward("erp", f"{downstream.url}/erp"),
            ]
        )
    )
    downstream.replies["/crm"] = [Reply(500), Reply(500)]
    store_event(app, clock, dedup_key="o-1")
    worker = make_worker(app, clock)
    assert sorted(drain(app, worker)) == ["delivered", "retry"]
    clock.advance(3600)
    assert drain(app, worker) == ["dead"]
    parsed = samples(app.test_client().get("/metrics").get_data(as_text=True))
    attempts = "webhook_receiver_delivery_attempts_total"
    crm, erp = {"source": SOURCE, "consumer": "crm"}, {"source": SOURCE, "consumer": "erp"}
    assert value(parsed, attempts, **crm, outcome="retry") == 1
    assert value(parsed, attempts, **crm, outcome="dead") == 1
    assert value(parsed, attempts, **erp, outcome="delivered") == 1
    assert value(parsed, "webhook_receiver_dead_letters_total", **crm) == 1
    assert value(parsed, "webhook_receiver_dead_letters_total", **erp) == 0


def _promtool_check(text: str) -> None:
    """``promtool check metrics``: the exposition parses and follows Prometheus' naming rules."""
    promtool = shutil.which("promtool")
    if promtool is None:
        unavailable("promtool is missing (apt-get install prometheus)")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _count_everything(client_or_url) -> None:
    for n in range(2):
        stripe(client_or_url, f"evt_{n}")
    stripe(client_or_url, "evt_0")  # a duplicate
    stripe(client_or_url, "evt_1", {"changed": True})  # a conflict
    stripe(client_or_url, "evt_9", secret="whsec_wrong")  # a signature failure


def test_promtool_accepts_the_scrape_of_one_process(app, client):
    _count_everything(client)
    client.get("/no/such/page")
    _promtool_check(client.get("/metrics").get_data(as_text=True))


@pytest.mark.slow
def test_promtool_accepts_the_scrape_of_gunicorns_workers(db_url, tmp_path):
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    with gunicorn(db_url, GUNICORN_CONFIG, tmp_path, workers=2, env=env) as server:
        _count_everything(f"{server.url}/webhooks/stripe-live")
        requests.get(f"{server.url}/no/such/page", timeout=10)
        text = requests.get(f"{server.url}/metrics", timeout=10).text
    assert "webhook_receiver_conflicts_total" in text
    _promtool_check(text)


def _worker_config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "worker.toml"
    path.write_text(
        f"""
[sources.{SOURCE}]
provider = "generic"
secrets = ["shop-secret-0123456789"]
signature_header = "X-Signature"

[[sources.{SOURCE}.forward]]
name = "crm"
url = "{url}"
timeout_seconds = 5
"""
    )
    return path


def _drain_in_a_worker(db_url: str, config: Path, prom: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "flask"), "--app", "wsgi", "worker", "--drain"],
        cwd=ROOT,
        env=app_env(db_url, config, {"PROMETHEUS_MULTIPROC_DIR": str(prom)}),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_worker_given_a_metrics_directory_not_made_yet_makes_it(
    make_app, db_url, tmp_path, downstream, clock
):
    # gunicorn.conf.py makes the directory for the web processes; a worker
    # started first, or alone (a directory under /run emptied by a reboot),
    # found none: prometheus_client failed to open its file at every count,
    # an ERROR with a traceback per attempt, and the counts were lost.
    app = make_app(config_with([forward("crm", f"{downstream.url}/crm")]))
    store_event(app, clock, dedup_key="o-1")
    prom = tmp_path / "run" / "metrics"
    result = _drain_in_a_worker(db_url, _worker_config(tmp_path, f"{downstream.url}/crm"), prom)
    assert result.returncode == 0, result.stderr
    assert "outcome hook" not in result.stderr, result.stderr
    assert len(downstream.calls_to("/crm")) == 1
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(prom))
    attempts = {
        (sample.labels["consumer"], sample.labels["outcome"]): sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == "webhook_receiver_delivery_attempts_total"
    }
    assert attempts == {("crm", "delivered"): 1.0}


def test_a_metrics_directory_that_cannot_be_made_stops_the_worker_with_one_line(
    db_url, tmp_path, downstream
):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    result = _drain_in_a_worker(
        db_url, _worker_config(tmp_path, f"{downstream.url}/crm"), blocked / "metrics"
    )
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("Error: PROMETHEUS_MULTIPROC_DIR"), result.stderr


def test_api_refusals_are_counted_by_client_and_reason(app, client):
    def post(body: bytes, content_type: str = "application/json", **headers: str):
        return client.post("/api/events", data=body, content_type=content_type, headers=headers)

    order = json.dumps({"type": "order.created", "data": 1}).encode()
    auth = bearer()
    assert (
        post(order, **{"Authorization": "Bearer wrong", "Idempotency-Key": "k"}).status_code == 401
    )
    assert post(order, **{"Idempotency-Key": "k"}).status_code == 401
    assert post(order, **auth, **{"Idempotency-Key": "a,b"}).status_code == 400
    assert post(order, **auth).status_code == 400  # no key
    assert post(b"{", **auth, **{"Idempotency-Key": "k1"}).status_code == 400
    assert post(b"[]", **auth, **{"Idempotency-Key": "k2"}).status_code == 400
    assert post(order, "text/plain", **auth, **{"Idempotency-Key": "k3"}).status_code == 415
    assert post(order, **auth, **{"Idempotency-Key": "k4"}).status_code == 201
    assert post(order, **auth, **{"Idempotency-Key": "k4"}).status_code == 201  # a replay

    parsed = samples(client.get("/metrics").get_data(as_text=True))
    refusals = {
        (dict(labels)["client"], dict(labels)["reason"]): found
        for (name, labels), found in parsed.items()
        if name == "webhook_receiver_api_refusals_total"
    }
    # Unauthenticated, the client is not named: its label stays empty.
    assert refusals == {
        ("", "unauthorized"): 2,
        ("acme", "idempotency-key-invalid"): 1,
        ("acme", "idempotency-key-missing"): 1,
        ("acme", "invalid-json"): 1,
        ("acme", "invalid-event"): 1,
        ("acme", "unsupported-media-type"): 1,
    }
