"""A worker's and a consumer's own ``/metrics`` (``--metrics-port``), scraped over HTTP.

Run as separate processes with no shared multiprocess directory (the
Procfile's worker and consumer dynos), their counts were written where no
scrape reached them: gunicorn's ``/metrics`` showed none of the worker's
attempts nor the consumer's receipts.
"""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from webhook_receiver.observability import metrics_server

from ..brokers.conftest import rabbit_source, start_consume
from ..brokers.running import log_tail, terminate, toml
from ..processing.conftest import config_with, forward, store_event
from ..servers import BIN, ROOT, app_env, stop, wait_until
from ..session_server import free_port
from .test_metrics import _worker_config, samples, value

TOKEN = "scrape-token-0123456789"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@contextmanager
def running_worker(
    db_url: str, config: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A real ``flask --app wsgi worker`` (no multiprocess directory), stopped at the end."""
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [str(BIN / "flask"), "--app", "wsgi", "worker", *args],
            cwd=ROOT,
            env=app_env(db_url, config, env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield process, log_path
    finally:
        stop(process)


def scrape(url: str, headers: dict[str, str] | None = None) -> requests.Response | None:
    try:
        return requests.get(url, headers=headers, timeout=5)
    except requests.ConnectionError:
        return None  # not listening yet


def assert_token_required(url: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = requests.get(url, headers=headers, timeout=5)
        assert refused.status_code == 401
        assert refused.headers["Content-Type"] == "application/problem+json"
        assert refused.json()["type"] == "/problems/unauthorized"
        assert refused.headers["WWW-Authenticate"].startswith("Bearer")


def test_a_worker_serves_its_attempts_on_its_own_port(
    make_app, db_url, tmp_path, downstream, clock
):
    app = make_app(config_with([forward("crm", f"{downstream.url}/crm")]))
    store_event(app, clock, dedup_key="o-1")
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    config = _worker_config(tmp_path, f"{downstream.url}/crm")
    env = {"WEBHOOK_RECEIVER_METRICS_TOKEN": TOKEN}
    with running_worker(db_url, config, tmp_path, "--metrics-port", str(port), env=env) as (
        process,
        log,
    ):
        assert wait_until(lambda: len(downstream.calls_to("/crm")) == 1, 30), log.read_text()

        def delivered() -> float:
            answer = scrape(url, BEARER)
            if answer is None or answer.status_code != 200:
                return 0.0
            parsed = samples(answer.text)
            return value(
                parsed,
                "webhook_receiver_delivery_attempts_total",
                source="shop",
                consumer="crm",
                outcome="delivered",
            )

        assert wait_until(lambda: delivered() == 1.0, 20), log.read_text()
        assert_token_required(url)
        # The port serves /metrics alone, never the app's other routes.
        other = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert other.status_code == 404
        assert other.headers["Content-Type"] == "application/problem+json"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log.read_text()
    assert "Traceback" not in log.read_text()


def test_a_worker_in_multiprocess_mode_serves_the_shared_directory(
    make_app, db_url, tmp_path, downstream, clock
):
    # One directory for the processes of a machine: the port serves every
    # process's counts, here those of a worker that has already exited.
    app = make_app(config_with([forward("crm", f"{downstream.url}/crm")]))
    config = _worker_config(tmp_path, f"{downstream.url}/crm")
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    store_event(app, clock, dedup_key="o-1")
    drained = subprocess.run(
        [str(BIN / "flask"), "--app", "wsgi", "worker", "--drain"],
        cwd=ROOT,
        env=app_env(db_url, config, env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert drained.returncode == 0, drained.stderr
    store_event(app, clock, dedup_key="o-2")
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with running_worker(db_url, config, tmp_path, "--metrics-port", str(port), env=env) as (
        _,
        log,
    ):
        assert wait_until(lambda: len(downstream.calls_to("/crm")) == 2, 30), log.read_text()

        def delivered() -> float:
            answer = scrape(url)
            if answer is None or answer.status_code != 200:
                return 0.0
            return value(
                samples(answer.text),
                "webhook_receiver_delivery_attempts_total",
                source="shop",
                consumer="crm",
                outcome="delivered",
            )

        assert wait_until(lambda: delivered() == 2.0, 20), (delivered(), log.read_text())


@pytest.mark.usefixtures("rabbit_url")
def test_a_consumer_serves_its_receipts_on_the_port_its_setting_names(
    make_app, db_url, tmp_path, amqp_queue
):
    sources = {"feed": rabbit_source(amqp_queue)}
    make_app({"sources": sources})
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    env = {"WEBHOOK_RECEIVER_METRICS_PORT": str(port), "WEBHOOK_RECEIVER_METRICS_TOKEN": TOKEN}
    process, log = start_consume(db_url, toml(sources), tmp_path, env=env)
    try:
        message = {"message_id": "m-1", "type": "order", "content_type": "application/json"}
        amqp_queue.publish([(b'{"order": 1}', message), (b'{"order": 1}', message)])

        def counted() -> tuple[float, float]:
            answer = scrape(url, BEARER)
            if answer is None or answer.status_code != 200:
                return (0.0, 0.0)
            parsed = samples(answer.text)
            return (
                value(parsed, "webhook_receiver_received_total", source="feed"),
                value(parsed, "webhook_receiver_duplicates_total", source="feed"),
            )

        assert wait_until(lambda: counted() == (1.0, 1.0), 30), (counted(), log_tail(log))
        assert_token_required(url)
    finally:
        code = terminate(process, log)
    assert code == 0, log_tail(log)


def test_a_metrics_port_already_taken_ends_the_worker_with_one_line(db_url, tmp_path, downstream):
    config = _worker_config(tmp_path, f"{downstream.url}/crm")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [str(BIN / "flask"), "--app", "wsgi", "worker", "--metrics-port", str(port)],
            cwd=ROOT,
            env=app_env(db_url, config),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: cannot serve metrics on 127.0.0.1:{port}: "), line
    assert "--metrics-port" in line


def test_a_metrics_port_setting_that_is_no_port_ends_the_consumer_with_one_line(db_url, tmp_path):
    config = tmp_path / "receiver.toml"
    config.write_text(toml({"feed": {"provider": "rabbitmq", "url": "amqp://x", "queue": "q"}}))
    result = subprocess.run(
        [str(BIN / "flask"), "--app", "wsgi", "consume"],
        cwd=ROOT,
        env=app_env(db_url, config, {"WEBHOOK_RECEIVER_METRICS_PORT": "metrics"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == (
        "Error: WEBHOOK_RECEIVER_METRICS_PORT must be a port number, got 'metrics'"
    )


def test_consume_list_serves_nothing_while_the_consumer_holds_the_port(db_url, tmp_path):
    # The container's environment names the port for the running consumer;
    # an operator's `consume --list` beside it was refused: port taken.
    config = tmp_path / "receiver.toml"
    config.write_text(toml({"feed": {"provider": "rabbitmq", "url": "amqp://x", "queue": "q"}}))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = subprocess.run(
            [str(BIN / "flask"), "--app", "wsgi", "consume", "--list"],
            cwd=ROOT,
            env=app_env(db_url, config, {"WEBHOOK_RECEIVER_METRICS_PORT": port}),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "feed\n"


def test_serving_metrics_asks_no_dns(make_app, monkeypatch):
    # http.server looked the bound address up (socket.getfqdn, a reverse DNS
    # query): in a container without DNS the worker's start waited for it.
    app = make_app({"sources": {}}, METRICS_TOKEN=TOKEN)
    looked_up: list[str] = []
    monkeypatch.setattr(socket, "getfqdn", lambda name="": looked_up.append(name) or name)
    port = free_port()
    with metrics_server.serving(app, port, "0.0.0.0") as url:
        assert url == f"http://0.0.0.0:{port}/metrics"
        answer = requests.get(f"http://127.0.0.1:{port}/metrics", headers=BEARER, timeout=5)
        assert answer.status_code == 200
    assert looked_up == []
