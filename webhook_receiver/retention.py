"""Retention: ``flask purge`` deletes what is past its lifetime, in bounded batches."""

from __future__ import annotations

from datetime import UTC, datetime

import click
from flask import Flask, current_app
from flask.cli import with_appcontext

from .idempotency import records


@click.command("purge")
@with_appcontext
@click.option("--batch-size", type=int, default=None, help="Rows deleted per transaction.")
def purge_command(batch_size: int | None) -> None:
    """Delete expired idempotency records (and events past their retention)."""
    size = batch_size or int(current_app.config["PURGE_BATCH_SIZE"])
    if size < 1:
        raise click.BadParameter("must be at least 1", param_hint="--batch-size")
    now = datetime.now(UTC)
    removed = records.purge_expired(now, size)
    click.echo(f"purged {removed} expired idempotency record(s)")


def init_app(app: Flask) -> None:
    """Register the purge command."""
    app.cli.add_command(purge_command)
