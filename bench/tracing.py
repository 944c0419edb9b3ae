"""What traces cost: ``python -m bench.tracing`` (CPU per request, traces off and on).

The app runs in this process (Flask's test client), as ``python -m bench
--profile`` does, twice over on one fresh migrated database: traces off,
and on with the provider the receiver builds in production
(``webhook_receiver.tracing.otlp_provider``: OTLP/HTTP, batched) sending to
a stand-in collector on loopback (it answers 200 to every export and keeps
nothing). The two take turns, a block of requests each (the order swapped
every block), so a change in the machine's load lands on both, and both
write to the same tables as they grow. Each block of the traced app ends
with a flush, so its export's CPU is counted in it. Printed: the process's
CPU time per request over all of each app's blocks, for a new API key, a
new signed webhook and a new broker message (stored in a consumer's batch
of 200: read, identified, one transaction, the batch's span), and the
ratio of "on" to "off". The intake's answer
waits for no export (spans are batched off the request's thread), so CPU
is what traces take from a worker.
"""

from __future__ import annotations

import argparse
import gc
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from webhook_receiver.brokers import batch
from webhook_receiver.brokers.identify import BrokerMessage

from .brokers import database
from .profile import _sources, _stderr_to_devnull
from .scenarios import EVENT_BODY, GITHUB_BODY, _github_headers

# Each app's requests of a kind: BLOCKS blocks of BLOCK, taking turns, short
# enough that a change in the machine's load lands on both. A block of
# webhooks is one export batch of 256 spans; one of API requests, half one.
BLOCKS = 12
BLOCK = 128
# A broker consumer's batch (bench.brokers' default), and the batches in a
# block: about as many messages as a block of webhooks is requests, times 25.
BROKER_BATCH = 200
BROKER_BLOCK = 16
BROKER_SOURCE = "bench-queue"


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector stand-in: reads each export and answers 200.

    HTTP/1.1, as a collector answers: the exporter keeps its connection
    rather than opening one per export.
    """

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args: Any) -> None:
        pass


def _provider(endpoint: str) -> Any:
    # The receiver's own provider (its exporter and batching), to the stand-in.
    from webhook_receiver.tracing import otlp_provider

    return otlp_provider(endpoint)


def _app(url: str, provider: Any, migrate: bool) -> Any:
    from flask_migrate import upgrade

    from webhook_receiver import create_app

    token = secrets.token_hex(24)
    # A RabbitMQ source that is never connected to: its batches are read
    # and stored as its consumer stores them.
    queue = {"provider": "rabbitmq", "url": "amqp://127.0.0.1/", "queue": "bench"}
    sources = {**_sources(), BROKER_SOURCE: queue}
    config: dict[str, Any] = {
        "SECRET_KEY": secrets.token_hex(32),
        "SQLALCHEMY_DATABASE_URI": url,
        "RECEIVER_CONFIG": {"clients": {"bench": {"token": token}}, "sources": sources},
    }
    if provider is not None:
        config["OTEL_TRACER_PROVIDER"] = provider
    app = create_app(config)
    if migrate:
        with app.app_context():
            upgrade()
    client = app.test_client()
    headers = {"Authorization": f"Bearer {token}"}

    def post(key: str) -> int:
        return client.post(
            "/api/events",
            data=EVENT_BODY,
            content_type="application/json",
            headers={**headers, "Idempotency-Key": key},
        ).status_code

    def deliver(key: str) -> int:
        return client.post(
            "/webhooks/bench-github", data=GITHUB_BODY, headers=_github_headers(key)
        ).status_code

    source = app.config["FILE_CONFIG"].brokers[BROKER_SOURCE]

    def consume(key: str) -> int:
        received = [
            BrokerMessage(EVENT_BODY, "application/json", properties={"message_id": f"{key}-{n}"})
            for n in range(BROKER_BATCH)
        ]
        with app.app_context():
            verdicts = batch.store(source, batch.prepare(source, received, lambda raw: raw))
        return 201 if all(verdict.action == batch.ACK for verdict in verdicts) else 500

    return {"api new key": post, "webhook new": deliver, BROKER_KIND: consume}


BROKER_KIND = f"broker message (batches of {BROKER_BATCH})"


def _measure(url: str, endpoint: str) -> dict[str, tuple[float, float]]:
    """Per request kind: CPU µs per request, traces off and on."""
    provider = _provider(endpoint)
    apps = {"off": _app(url, None, True), "on": _app(url, provider, False)}
    result = {}
    with _stderr_to_devnull():
        for tag, sends in apps.items():
            for i in range(100):
                for name, send in sends.items():
                    assert send(f"{tag}-warm-{name}-{i}") in (200, 201)
        provider.force_flush()
        for name in apps["off"]:
            # A collected heap to start from: a full collection set off by the
            # migrations' or the apps' start would land on either app. Within
            # the blocks, collections land where they fall, on both.
            gc.collect()
            cpu = {"off": 0.0, "on": 0.0}
            # A broker batch is timed per message.
            count, messages = (BROKER_BLOCK, BROKER_BATCH) if name == BROKER_KIND else (BLOCK, 1)
            for block in range(BLOCKS):
                order = ("off", "on") if block % 2 == 0 else ("on", "off")
                for tag in order:
                    send = apps[tag][name]
                    start = time.process_time()
                    for i in range(count):
                        assert send(f"{tag}-{name}-{block}-{i}") in (200, 201)
                    if tag == "on":
                        provider.force_flush()
                    cpu[tag] += time.process_time() - start
            per = BLOCKS * count * messages / 1e6
            result[name] = (cpu["off"] / per, cpu["on"] / per)
    provider.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=["sqlite", "postgresql", "both"], default="both")
    args = parser.parse_args(argv)
    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    pg_url = os.environ.get("BENCH_DATABASE_URL") or os.environ.get("TEST_DATABASE_URL")
    dbs = ["sqlite", "postgresql"] if args.db == "both" else [args.db]
    print("| database | request | off (CPU µs) | on (CPU µs) | on / off |")
    print("|---|---|---:|---:|---:|")
    for db in dbs:
        if db == "postgresql" and not pg_url:
            print("no BENCH_DATABASE_URL or TEST_DATABASE_URL: PostgreSQL skipped")
            continue
        workdir = Path(tempfile.mkdtemp(prefix="wr-tracing-"))
        try:
            with database(db, workdir) as url:
                measured = _measure(url, endpoint)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        for name, (off, on) in measured.items():
            print(f"| {db} | {name} | {off:.0f} | {on:.0f} | {on / off:.2f} |")
    collector.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
