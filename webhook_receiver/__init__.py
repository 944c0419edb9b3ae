"""webhook-receiver: an idempotent webhook receiver and Idempotency-Key API."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from flask import Flask

from . import config as cfg
from .extensions import csrf, db, migrate


def create_app(test_config: Mapping[str, Any] | None = None) -> Flask:
    """Create and configure the application.

    Settings come from the defaults, then the environment, then (for tests)
    ``test_config``. The TOML file named by ``WEBHOOK_RECEIVER_CONFIG`` (or
    the ``RECEIVER_CONFIG`` mapping in ``test_config``) declares clients and
    sources.
    """
    app = Flask(__name__, instance_relative_config=True)
    os.makedirs(app.instance_path, exist_ok=True)

    app.config.from_mapping(cfg.DEFAULTS)
    # Before Flask reads them: a name nested in a setting that is no table
    # would end in its TypeError.
    cfg.check_environment_names(os.environ)
    app.config.from_prefixed_env("WEBHOOK_RECEIVER")
    if os.environ.get("SECRET_KEY"):
        app.config["SECRET_KEY"] = os.environ["SECRET_KEY"]
    app.config["SQLALCHEMY_DATABASE_URI"] = cfg.database_uri(
        os.environ.get("DATABASE_URL"), app.instance_path
    )
    if test_config is not None:
        app.config.from_mapping(test_config)

    cfg.check_settings(app.config)
    from .webhooks.providers import PROVIDERS

    app.config["FILE_CONFIG"] = cfg.load_for_app(
        app.config, app.instance_path, providers=PROVIDERS.keys()
    )
    cfg.check_secret_key(app.config, app.instance_path, lenient=app.debug or app.testing)
    cfg.check_retention(app.config, app.config["FILE_CONFIG"])

    uri = app.config["SQLALCHEMY_DATABASE_URI"] = cfg.database_uri(
        app.config["SQLALCHEMY_DATABASE_URI"], app.instance_path
    )
    from .database import engine_options

    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {
        # A failed statement's message would otherwise carry its parameters
        # (bodies, headers) into the logs.
        "hide_parameters": True,
        **engine_options(uri, transaction_pooler=bool(app.config["TRANSACTION_POOLER"])),
        **app.config["SQLALCHEMY_ENGINE_OPTIONS"],
    }
    proxies = int(app.config["TRUSTED_PROXIES"])
    if proxies:
        from werkzeug.middleware.proxy_fix import ProxyFix

        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=proxies, x_proto=proxies)  # type: ignore[method-assign]
    # Werkzeug refuses larger bodies with 413 before a view reads them.
    app.config["MAX_CONTENT_LENGTH"] = int(app.config["MAX_BODY_BYTES"])
    app.config.setdefault("SESSION_COOKIE_HTTPONLY", True)
    app.config["SESSION_COOKIE_SAMESITE"] = "Lax"
    # CSRF is checked per view by the admin blueprint, not on machine APIs.
    app.config["WTF_CSRF_CHECK_DEFAULT"] = False

    from .sessions import AdminOnlySessionInterface

    app.session_interface = AdminOnlySessionInterface()
    db.init_app(app)
    migrate.init_app(app, db, directory=_migrations_dir())
    csrf.init_app(app)

    from . import correlation, database, observability, problems, tracing

    database.init_app(app)
    problems.init_app(app)
    correlation.init_app(app)
    observability.init_app(app)
    tracing.init_app(app)

    from . import openapi, problem_pages

    problem_pages.init_app(app)
    openapi.init_app(app)

    from .admin import bp as admin_bp
    from .api import bp as api_bp
    from .health import bp as health_bp
    from .webhooks.views import bp as webhooks_bp

    app.register_blueprint(health_bp)
    app.register_blueprint(api_bp)
    app.register_blueprint(webhooks_bp)
    app.register_blueprint(admin_bp)

    from . import retention

    retention.init_app(app)

    from . import inbox, processing

    processing.init_app(app)
    inbox.init_app(app, processing.routes(app))

    from .brokers.cli import consume_command
    from .brokers.manage import brokers_group
    from .processing.cli import worker_command
    from .processing.deliveries_cli import deliveries_group

    app.cli.add_command(worker_command)
    app.cli.add_command(consume_command)
    app.cli.add_command(brokers_group)
    app.cli.add_command(deliveries_group)
    # Delivery attempts reach the metrics through the registry's outcome hooks.
    observability.metrics.watch_deliveries(app)

    from . import cli

    cli.init_app(app)
    return app


def _migrations_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "migrations")
