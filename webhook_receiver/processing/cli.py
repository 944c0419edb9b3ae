"""``flask --app wsgi worker``: run the delivery worker until SIGTERM."""

from __future__ import annotations

import logging

import click
from flask import current_app
from flask.cli import with_appcontext

from ..config import ConfigError
from .worker import Worker


@click.command("worker")
@with_appcontext
@click.option(
    "--drain", is_flag=True, help="Exit once no delivery is due instead of waiting for more."
)
def worker_command(drain: bool) -> None:
    """Process deliveries: run handlers and forwards, retry, until SIGTERM."""
    if not logging.getLogger().handlers:
        # The app configures JSON logs (observability.logging) except when
        # testing or configured elsewhere; then plain lines rather than none.
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    logging.getLogger("webhook_receiver.processing").setLevel(logging.INFO)
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    try:
        worker = Worker(app)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    done = worker.run(drain=drain)
    click.echo(f"worker processed {done} deliveries")
