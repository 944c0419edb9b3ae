"""Inbox throughput: ``python -m bench.inbox``.

New events stored per second by one process (as a broker consumer stores
them), on SQLite and PostgreSQL:

- ``bare insert``: the baseline, a Core ``INSERT ... ON CONFLICT DO NOTHING``
  and a commit per event on a pooled connection, nothing else;
- ``receive``: ``inbox.receive()``, one message at a time (the webhook path);
- ``receive_many/N``: ``inbox.receive_many()`` with batches of N messages,
  one transaction each.

``--consumer`` calls receive_many as a broker consumer does (a content
fingerprint, the redeliveries' counts in the batch's transaction) and adds
``again/N``: the same messages a second time, every one a redelivery.
``--busy-thread`` runs a thread of pure Python beside the batches, as a
consumer's reading thread is beside its storing one: each time the
storing thread waits for the database it must get the GIL back from it.

Each case stores ``--events`` fresh messages whose source has one forward,
so each new event also writes its delivery (the outbox). Ratios are against
the bare insert of the same database in the same run. PostgreSQL is the
server of ``BENCH_DATABASE_URL``, else ``TEST_DATABASE_URL``. It measures,
it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite

from .worker import RESULTS, databases

SOURCE = "bench-inbox"
SECRET_KEY = "bench-secret-key-0123456789abcdef"
CONFIG = {
    "sources": {
        SOURCE: {
            "provider": "generic",
            "secrets": ["bench-secret-0123456789"],
            "signature_header": "X-Signature",
            "forward": [{"name": "downstream", "url": "http://127.0.0.1:9/hooks"}],
        }
    }
}


def _app(db_url: str) -> Any:
    from flask_migrate import upgrade

    from webhook_receiver import create_app

    app = create_app(
        {
            "SECRET_KEY": SECRET_KEY,
            "SQLALCHEMY_DATABASE_URI": db_url,
            "RECEIVER_CONFIG": CONFIG,
            "LOG_LEVEL": "WARNING",
        }
    )
    with app.app_context():
        upgrade()
    return app


def _messages(n: int) -> list[Any]:
    from webhook_receiver import inbox

    run = secrets.token_hex(4)
    return [
        inbox.Message(
            source=SOURCE,
            dedup_key=f"{run}-{i}",
            fingerprint=secrets.token_hex(32),
            body=b'{"type": "bench.event", "data": {"i": %d}}' % i,
            event_type="bench.event",
            content_type="application/json",
            headers=(("Content-Type", "application/json"),),
        )
        for i in range(n)
    ]


def _bare(app: Any) -> Callable[[list[Any]], None]:
    from webhook_receiver.extensions import db
    from webhook_receiver.inbox.rows import event_values
    from webhook_receiver.models import Event

    def run(messages: list[Any]) -> None:
        engine = db.engine
        dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
        statement = dialect.insert(Event.__table__).on_conflict_do_nothing()
        now = datetime.now(UTC)
        with engine.connect() as conn:
            for message in messages:
                conn.execute(statement, event_values(message, now))
                conn.commit()

    return run


def _receive(messages: list[Any]) -> None:
    from webhook_receiver import inbox

    for message in messages:
        inbox.receive(message)


def _receive_many(size: int, *, consumer: bool = False) -> Callable[[list[Any]], None]:
    def run(messages: list[Any]) -> None:
        from webhook_receiver import inbox

        options: dict[str, Any] = {}
        if consumer:  # as brokers.batch.store calls it
            options = {"content_fingerprint": _content_fingerprint, "counts_in_transaction": True}
        for start in range(0, len(messages), size):
            inbox.receive_many(messages[start : start + size], **options)

    return run


def _content_fingerprint(body: bytes, event_type: str | None, content_type: str | None) -> str:
    from webhook_receiver.fingerprint import fingerprint

    return fingerprint([event_type or "", body])


@contextmanager
def _busy_thread(on: bool) -> Iterator[None]:
    """A thread of pure Python for the block, when ``on``."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, daemon=True)
    if on:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if on:
            thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inbox", description=__doc__)
    parser.add_argument("--events", type=int, default=3000, help="new events per case")
    parser.add_argument("--db", choices=["sqlite", "postgresql"], help="only this database")
    parser.add_argument("--batches", default="1,10,100,500", help="receive_many batch sizes")
    parser.add_argument(
        "--consumer", action="store_true", help="receive_many as a broker consumer calls it"
    )
    parser.add_argument(
        "--busy-thread", action="store_true", help="a thread of pure Python beside the batches"
    )
    args = parser.parse_args(argv)
    pg_url = os.environ.get("BENCH_DATABASE_URL") or os.environ.get("TEST_DATABASE_URL")
    sizes = [int(s) for s in args.batches.split(",") if s]
    lines = [
        "| db | case | events | seconds | events/s | vs bare insert |",
        "|---|---|---:|---:|---:|---:|",
    ]
    with databases(pg_url, args.db) as found:
        for name, url in found:
            app = _app(url)
            cases: list[tuple[str, Callable[[list[Any]], None]]] = [
                ("bare insert", _bare(app)),
                ("receive", _receive),
                *[
                    (f"receive_many/{size}", _receive_many(size, consumer=args.consumer))
                    for size in sizes
                ],
            ]
            if args.consumer:  # stored once first, not timed: every one a redelivery
                cases += [(f"again/{size}", _receive_many(size, consumer=True)) for size in sizes]
            base = None
            with app.app_context():
                _receive_many(100)(_messages(200))  # warm up: connections, statements
                for case, run in cases:
                    messages = _messages(args.events)
                    if case.startswith("again/"):
                        run(messages)
                    busy = args.busy_thread and case.startswith(("receive_many/", "again/"))
                    with _busy_thread(busy):
                        started = time.perf_counter()
                        run(messages)
                        seconds = time.perf_counter() - started
                    rate = args.events / seconds
                    base = base or rate
                    line = (
                        f"| {name} | {case} | {args.events} | {seconds:.2f} "
                        f"| {rate:,.0f} | {rate / base:.2f} |"
                    )
                    print(line, flush=True)
                    lines.append(line)
                from webhook_receiver.extensions import db

                app.extensions["webhook_receiver.duplicates"].close()
                db.engine.dispose()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"inbox-{datetime.now(UTC):%Y%m%d-%H%M%S}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
