"""``/metrics`` of a worker or consumer process, on a port of its own.

Under ``make run`` every process writes to one ``PROMETHEUS_MULTIPROC_DIR``
and gunicorn's ``/metrics`` reads them all. Run as separate dynos or
containers (the Procfile), a worker's attempts and a consumer's receipts
were counted where no scrape could reach them. ``--metrics-port`` (or
``WEBHOOK_RECEIVER_METRICS_PORT``) makes ``flask worker`` and ``flask
consume`` serve ``GET /metrics`` themselves while they run.

The answer is the app's own ``/metrics`` view, dispatched through the app:
the same token rule (401 problem+json without the bearer), the same formats,
the multiprocess directory when one is set and the process's own registry
otherwise. Any other path is a 404: this port is no second web intake.
prometheus_client's ``start_http_server`` cannot check a token, hence this
small wsgiref server on a thread.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from socketserver import TCPServer, ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import click
from flask import Flask
from flask.cli import ScriptInfo

from ..config import ConfigError

log = logging.getLogger(__name__)

PORT_ENV = "WEBHOOK_RECEIVER_METRICS_PORT"
HOST_ENV = "WEBHOOK_RECEIVER_METRICS_HOST"
# Loopback unless asked otherwise: a scraper in the same container, pod or
# host reaches it, the internet does not.
DEFAULT_HOST = "127.0.0.1"
PATH = "/metrics"
# A scraper that stops reading holds one thread this long at most.
CLIENT_TIMEOUT_SECONDS = 10

_ADDED = "_webhook_receiver_serves_metrics"

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds the process at exit

    def server_bind(self) -> None:
        # HTTPServer's would look the address up (socket.getfqdn): a reverse
        # DNS query that, in a container without DNS, holds the start for seconds.
        TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])
        self.setup_environ()


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    timeout = CLIENT_TIMEOUT_SECONDS

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base's name)
        # One stderr line per scrape, every 15 s, is noise in the worker's log.
        log.debug("metrics scrape: " + format, *args)


def metrics_only(app: Flask) -> WSGIApp:
    """The app's ``/metrics`` and nothing else: any other path answers 404 problem+json."""

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == PATH:
            return app.wsgi_app(environ, start_response)  # type: ignore[no-any-return]
        # Written here: problems.py (through cli.py) imports this module.
        body = json.dumps(
            {
                "type": "/problems/not-found",
                "title": "Not found",
                "status": 404,
                "detail": f"this port serves {PATH} only",
            }
        ).encode()
        start_response(
            "404 Not Found",
            [("Content-Type", "application/problem+json"), ("Content-Length", str(len(body)))],
        )
        return [body]

    return serve


def _port(value: object) -> int | None:
    if value is None or value == "":
        return None
    # The environment's value comes as JSON (an int) or, quoted, as text.
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{PORT_ENV} must be a port number, got {value!r}")
    try:
        port = int(value)
    except ValueError:
        raise ConfigError(f"{PORT_ENV} must be a port number, got {value!r}") from None
    if not 1 <= port <= 65535:
        raise ConfigError(f"{PORT_ENV} must be between 1 and 65535, got {port}")
    return port


def _host(value: object) -> str:
    if value is None or value == "":
        return DEFAULT_HOST
    if not isinstance(value, str):
        raise ConfigError(f"{HOST_ENV} must be an address, got {value!r}")
    return value.strip("[]")  # [::1] as in a URL


@contextmanager
def serving(app: Flask, port: int | None = None, host: str | None = None) -> Iterator[str | None]:
    """Serve the app's ``/metrics`` on ``host:port`` (else the app's settings) during the block.

    Yields the URL, or None when no port is set. A port that cannot be bound
    (taken, privileged, an address not of this host) is a ConfigError: the
    command ends with one line saying so, before it starts its work.
    """
    port = _port(port if port is not None else app.config.get("METRICS_PORT"))
    host = _host(host if host is not None else app.config.get("METRICS_HOST"))
    if port is None:
        yield None
        return
    server_class = _Server6 if ":" in host else _Server
    try:
        server = make_server(
            host, port, metrics_only(app), server_class=server_class, handler_class=_QuietHandler
        )
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} "
            f"(another process on that port? choose another with --metrics-port or {PORT_ENV})"
        ) from exc
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{server.server_port}{PATH}"
    thread = threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True)
    thread.start()
    log.info("metrics served at %s", url, extra={"outcome": "metrics_serving"})
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


_PORT_OPTION = click.Option(
    ["--metrics-port"],
    type=click.IntRange(1, 65535),
    default=None,
    help=f"Serve this process's GET /metrics on this port (default: {PORT_ENV}; none when unset).",
)
_HOST_OPTION = click.Option(
    ["--metrics-host"],
    default=None,
    help=f"The address --metrics-port binds (default: {HOST_ENV}, else {DEFAULT_HOST}).",
)


def serve_while_running(command: click.Command, unless: tuple[str, ...] = ()) -> None:
    """Give a long-running command ``--metrics-port``/``--metrics-host``, serving ``/metrics``.

    ``unless`` names flags that make a run a quick look (``consume --list``):
    it serves nothing then, so it never fights the running process for its port.
    """
    # Command objects are module-level and shared by every app a process
    # makes (tests make hundreds): give each its options once.
    if getattr(command, _ADDED, False):
        return
    command.params.extend([_PORT_OPTION, _HOST_OPTION])
    invoke = command.invoke

    # Not functools.wraps: cli.py's one-line wrapper goes around this one,
    # and tests/test_cli.py finds a command wrapped twice by its __wrapped__ chain.
    def invoke_serving(ctx: click.Context) -> Any:
        # The command's own function takes neither option.
        port = ctx.params.pop("metrics_port", None)
        host = ctx.params.pop("metrics_host", None)
        if any(ctx.params.get(flag) for flag in unless):
            return invoke(ctx)
        app = ctx.ensure_object(ScriptInfo).load_app()
        with serving(app, port, host):
            return invoke(ctx)

    command.invoke = invoke_serving  # type: ignore[method-assign]
    setattr(command, _ADDED, True)
