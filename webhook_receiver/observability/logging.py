"""Structured logs: one JSON object per line, each with the request's correlation id.

The inbox logs one line per delivery (or per batch, naming each message)
with ``source``, ``dedup_key``, ``event_id`` and ``outcome``; the
Idempotency-Key engine one per request with ``source``, ``client``,
``dedup_key``, ``outcome`` and ``status`` (it knows no event: the API's
answer names it). Fields are passed through ``extra``, and every line
carries the request's ``correlation_id``. Callers never put
secrets or bodies in a line; JSON escaping keeps a key with CR/LF from
forging a line of its own, and a value JSON cannot hold (a lone surrogate,
an integer past 64 bits) is made writable rather than the line lost.

``create_app`` installs the handler on the package's logger unless the app
is testing or logging is already configured (a handler on the root logger,
or on the package logger that is not ours), so an operator's own logging
set-up always wins.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import IO, Any

from flask import Flask, g, has_request_context
from flask.logging import default_handler
from pythonjsonlogger.orjson import OrjsonFormatter

from ..config import ConfigError

PACKAGE_LOGGER = "webhook_receiver"
FORMATS = ("json", "text")
# The fields a text line shows after its message, when a record has them.
FIELDS = ("source", "dedup_key", "event_id", "outcome", "client", "status", "correlation_id")


class CorrelationFilter(logging.Filter):
    """Give every record logged during a request that request's correlation id."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "correlation_id", None) is None and has_request_context():
            record.correlation_id = g.get("correlation_id")
        return True


class TextFormatter(logging.Formatter):
    """A plain line, then the structured fields as ``key=value`` (repr-quoted)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        pairs = [
            f"{name}={getattr(record, name)!r}"
            for name in FIELDS
            if getattr(record, name, None) is not None
        ]
        return " ".join([line, *pairs]) if pairs else line


_SURROGATES = re.compile("[\ud800-\udfff]")
_INT64 = range(-(2**63), 2**64)


def _writable(value: Any) -> Any:
    """``value`` as orjson writes it: lone surrogates replaced (U+FFFD), huge integers as text."""
    if isinstance(value, str):
        return _SURROGATES.sub("\ufffd", value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value in _INT64 else str(value)
    if isinstance(value, dict):
        return {_writable(key): _writable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_writable(item) for item in value]
    return value


class _JsonFormatter(OrjsonFormatter):
    """orjson's formatter, whose every record makes a line.

    orjson writes no lone surrogate (JSON's ``\\uD800`` escape, parsed from
    what a client sent, an exception quoting it) and no integer past 64
    bits: it raised, and logging printed a traceback to stderr instead of
    the line. Such a record is written again with its values made writable;
    the usual one pays nothing.
    """

    def jsonify_log_record(self, log_data: Any) -> str:
        try:
            return super().jsonify_log_record(log_data)
        except TypeError:
            return super().jsonify_log_record(_writable(log_data))


def json_formatter() -> logging.Formatter:
    """The JSON formatter: time, level, logger, message, then every ``extra`` field.

    python-json-logger's orjson flavour: a line in half the time of its
    json one (3.8 against 8.2 us for a receipt's line), on every request.
    """
    return _JsonFormatter(
        "%(levelname)s %(name)s %(message)s",
        rename_fields={"levelname": "level", "name": "logger"},
        timestamp="time",
    )


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Our handler, told apart from an operator's so a second app replaces it."""


def configure(fmt: str = "json", level: str | int = "INFO", stream: IO[str] | None = None) -> None:
    """Send the package's logs to ``stream`` (stderr) as JSON or text lines."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    logger = logging.getLogger(PACKAGE_LOGGER)
    for old in [h for h in logger.handlers if isinstance(h, _Handler) or h is default_handler]:
        logger.removeHandler(old)
    handler = _Handler(stream or sys.stderr)
    handler.setFormatter(json_formatter() if fmt == "json" else TextFormatter())
    handler.addFilter(CorrelationFilter())
    logger.addHandler(handler)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    # We own the package's lines now; a root handler added later must not
    # print them a second time.
    logger.propagate = False


def adopt(name: str, level: int = logging.WARNING) -> None:
    """Send a client library's lines (pika, nats) through the package's handlers, at ``level``.

    Otherwise they reach the root logger, as plain text between the JSON
    lines, or Python's last-resort handler.
    """
    library = logging.getLogger(name)
    library.setLevel(level)
    ours = [h for h in logging.getLogger(PACKAGE_LOGGER).handlers if isinstance(h, _Handler)]
    if not ours:
        return  # logging is someone else's (a test, an operator's set-up): lines propagate
    for old in [h for h in library.handlers if isinstance(h, _Handler)]:
        library.removeHandler(old)
    for handler in ours:
        library.addHandler(handler)
    library.propagate = False


def already_configured() -> bool:
    """Tell whether someone else configured logging (the root or the package logger)."""
    if logging.getLogger().handlers:
        return True
    package = logging.getLogger(PACKAGE_LOGGER)
    return any(not isinstance(h, _Handler) and h is not default_handler for h in package.handlers)


def log_level(value: Any) -> str | int:
    """The ``LOG_LEVEL`` setting as ``logging`` takes it (INFO when unset), or ConfigError."""
    if value is None or value == "":
        return "INFO"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        name = value.strip().upper()
        if name.isdigit():
            return int(name)
        if name in logging.getLevelNamesMapping():
            return name
    raise ConfigError(
        f"LOG_LEVEL must be a level name (DEBUG, INFO, WARNING, ERROR, CRITICAL) or a "
        f"number, not {value!r}"
    )


def init_app(app: Flask) -> None:
    """Configure JSON (or text) logs for this app, unless testing or configured elsewhere."""
    fmt: Any = app.config.get("LOG_FORMAT") or ("text" if app.debug else "json")
    if fmt not in FORMATS:
        raise ConfigError(f"LOG_FORMAT must be one of {', '.join(FORMATS)}, not {fmt!r}")
    # Checked here, like the format: logging's own ValueError would end
    # create_app with a traceback.
    level = log_level(app.config.get("LOG_LEVEL"))
    if app.testing or already_configured():
        return
    configure(fmt, level)


def loggable(value: Any) -> str | None:
    """``value`` if a JSON log line can name it: text of at most 512 characters, UTF-8, no NUL.

    orjson writes no lone surrogate (the whole line would be lost), and a
    longer value is no key an operator searches for.
    """
    if not isinstance(value, str) or len(value) > 512 or "\x00" in value:
        return None
    try:
        value.encode()
    except UnicodeEncodeError:
        return None
    return value
