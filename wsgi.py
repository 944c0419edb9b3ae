"""The WSGI entry point: ``gunicorn wsgi:app`` and ``flask --app wsgi``."""

import click

from webhook_receiver import create_app
from webhook_receiver.config import ConfigError

try:
    app = create_app()
except ConfigError as exc:
    if click.get_current_context(silent=True) is None:
        raise  # gunicorn: a worker that cannot boot stops the server
    # Under the flask CLI: one line naming the fix, not a traceback.
    raise SystemExit(f"Error: {exc}") from None
