"""What traces cost: ``python -m bench.tracing`` (CPU per request, traces off and on).

The app runs in this process (Flask's test client), as ``python -m bench
--profile`` does, on a fresh migrated database, three times over: traces
off, then on with the provider the receiver builds in production
(``webhook_receiver.tracing.otlp_provider``: OTLP/HTTP, batched) sending to
a stand-in collector on loopback (it answers 200 to every export and keeps
nothing), then off again. Each prints the process's CPU time per request
for a new API key and a new signed webhook (each measure from a collected
heap), and the ratio of "on" to the mean of the two "off" rounds. The intake's answer
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

from .brokers import database
from .profile import _sources, _stderr_to_devnull
from .scenarios import EVENT_BODY, GITHUB_BODY, _github_headers

REQUESTS = 1500


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector stand-in: reads each export and answers 200."""

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


def _round(url: str, provider: Any, tag: str) -> dict[str, float]:
    from flask_migrate import upgrade

    from webhook_receiver import create_app

    token = secrets.token_hex(24)
    config: dict[str, Any] = {
        "SECRET_KEY": secrets.token_hex(32),
        "SQLALCHEMY_DATABASE_URI": url,
        "RECEIVER_CONFIG": {"clients": {"bench": {"token": token}}, "sources": _sources()},
    }
    if provider is not None:
        config["OTEL_TRACER_PROVIDER"] = provider
    app = create_app(config)
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

    cpu = {}
    with _stderr_to_devnull():
        for i in range(100):
            post(f"{tag}-warm-{i}")
            deliver(f"{tag}-warm-{i}")
        for name, send in (("api new key", post), ("webhook new", deliver)):
            # Each measure starts from a collected heap: a full collection set
            # off by an earlier round's garbage (the migrations', the app's
            # start) would land on whichever round came next.
            gc.collect()
            start = time.process_time()
            for i in range(REQUESTS):
                assert send(f"{tag}-{name}-{i}") in (200, 201)
            cpu[name] = (time.process_time() - start) / REQUESTS * 1e6
    if provider is not None:
        provider.force_flush()
    return cpu


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
        rounds = []
        if db == "postgresql" and not pg_url:
            print("no BENCH_DATABASE_URL or TEST_DATABASE_URL: PostgreSQL skipped")
            continue
        for tag, provider in (("off1", None), ("on", _provider(endpoint)), ("off2", None)):
            workdir = Path(tempfile.mkdtemp(prefix="wr-tracing-"))
            try:
                with database(db, workdir) as url:
                    rounds.append(_round(url, provider, tag))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        if len(rounds) < 3:
            continue
        off1, on, off2 = rounds
        for name in on:
            off = (off1[name] + off2[name]) / 2
            print(f"| {db} | {name} | {off:.0f} | {on[name]:.0f} | {on[name] / off:.2f} |")
    collector.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
