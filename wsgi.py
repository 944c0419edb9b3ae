"""The WSGI entry point: ``gunicorn wsgi:app`` and ``flask --app wsgi``."""

from webhook_receiver import create_app

app = create_app()
