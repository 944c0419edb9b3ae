"""``flask --app wsgi consume [SOURCE ...]``: consume broker sources until SIGTERM."""

from __future__ import annotations

import logging
import threading

import click
from flask import current_app
from flask.cli import with_appcontext

from ..config import ConfigError
from ..observability import logging as log_setup
from . import runner

# pika's loggers that narrate a connection attempt's steps and failure, and a
# channel the broker closed (a missing queue, on each retry): the consumer
# says each of these once, with its cause.
PIKA_NARRATION = (
    "pika.adapters.utils.io_services_utils",
    "pika.adapters.utils.connection_workflow",
    "pika.adapters.blocking_connection",
    "pika.channel",
)


@click.command("consume")
@click.argument("sources", nargs=-1)
@click.option("--list", "list_only", is_flag=True, help="Print the broker sources' names and exit.")
@with_appcontext
def consume_command(sources: tuple[str, ...], list_only: bool) -> None:
    """Consume the named broker sources (all of them by default) into the inbox."""
    if list_only:
        for name in current_app.config["FILE_CONFIG"].brokers:
            click.echo(name)
        return
    if not logging.getLogger().handlers:
        # As the worker command does: plain lines when nothing configured logging.
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    logging.getLogger("webhook_receiver.brokers").setLevel(logging.INFO)
    # The clients' own lines, at WARNING, as JSON like ours. pika says a
    # failed connection seven times, once with a traceback; the consumer
    # says it once per attempt, with its cause.
    for library in ("pika", "nats"):
        log_setup.adopt(library)
    for step in PIKA_NARRATION:
        logging.getLogger(step).setLevel(logging.CRITICAL)
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    try:
        chosen = runner.sources_to_consume(app.config["FILE_CONFIG"], sources)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    runner.run(app, chosen, threading.Event())
    click.echo(f"consume stopped ({', '.join(s.name for s in chosen)})")
