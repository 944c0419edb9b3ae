"""Plain settings: their defaults, the environment's numbers checked, the database URL.

Plain settings come from the environment (``DATABASE_URL``, ``SECRET_KEY``
and ``WEBHOOK_RECEIVER_*``, read by Flask's ``from_prefixed_env``) over
``DEFAULTS``; ``check_settings`` coerces the numeric ones and says which is
wrong.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from flask import Flask
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

# Stripe and Standard Webhooks retry for about three days; operators replay
# dead letters later still. Markers kept for less let duplicates back in.
MIN_RETENTION_DAYS = 3

DEFAULTS: dict[str, Any] = {
    "MAX_BODY_BYTES": 1024 * 1024,
    "IDEMPOTENCY_LEASE_SECONDS": 60,
    "IDEMPOTENCY_TTL_SECONDS": 24 * 3600,
    # How long a request waits for another's uncommitted claim of its key
    # (PostgreSQL's lock_timeout) before answering 409.
    "IDEMPOTENCY_LOCK_TIMEOUT_SECONDS": 5.0,
    "PURGE_BATCH_SIZE": 1000,
    # Days events are kept when no [sources.*] table says: API events
    # (``api:<client>``), and events of a source since removed from the file.
    "API_RETENTION_DAYS": 30,
    "DEFAULT_RETENTION_DAYS": 30,
    # json or text; unset means json, or text when debugging.
    "LOG_FORMAT": None,
    "LOG_LEVEL": "INFO",
    "ADMIN_PASSWORD": None,
    "METRICS_TOKEN": None,
    # flask worker / flask consume serve their own /metrics on this port
    # (observability/metrics_server.py), bound to METRICS_HOST or loopback.
    "METRICS_PORT": None,
    "METRICS_HOST": None,
    "SESSION_COOKIE_SECURE": False,
    # How many reverse proxies in front set X-Forwarded-For/-Proto; 0 trusts
    # none. Login throttling and logs use the client address they give.
    "TRUSTED_PROXIES": 0,
    # Connections go through pgbouncer in transaction mode (see docs/scaling.md).
    "TRANSACTION_POOLER": False,
    # The admin's knobs.
    "ADMIN_SESSION_HOURS": 12,
    "ADMIN_LOGIN_MAX_FAILURES": 5,
    "ADMIN_LOGIN_WINDOW_SECONDS": 900,
    "ADMIN_PAGE_SIZE": 50,
    "FORCE_SHORT_RETENTION": False,
    # Redeliveries' counts and times are written in batches this often (see
    # duplicates.py); 0 writes each in its own request.
    "DUPLICATE_FLUSH_SECONDS": 1.0,
    # Refused deliveries are counted per source, reason, address and minute,
    # and written this often (see rejections.py); 0 writes each at once.
    "REJECTION_FLUSH_SECONDS": 1.0,
    "SQLALCHEMY_ENGINE_OPTIONS": {},
    # The delivery worker (webhook_receiver.processing). A lease must outlast
    # the slowest forward: connect and read timeouts both count.
    "WORKER_LEASE_SECONDS": 60,
    "WORKER_POLL_SECONDS": 1.0,
    "WORKER_MAX_ATTEMPTS": 8,
    "WORKER_BACKOFF_BASE_SECONDS": 30,
    "WORKER_BACKOFF_MAX_SECONDS": 3600,
    "WORKER_RETRY_AFTER_MAX_SECONDS": 24 * 3600,
    # Deliveries one worker process runs at once; each forward takes at most
    # its ``concurrency`` of them (see docs/processing.md).
    "WORKER_THREADS": 4,
    # Every attempt of every delivery is a row of the attempt log (docs/processing.md);
    # false keeps only each delivery's last error, as before the log.
    "WORKER_ATTEMPT_LOG": True,
    # PostgreSQL connections (database.init_app): a statement running longer
    # is cancelled, and answered as the database being away; 0 sets none.
    "DATABASE_STATEMENT_TIMEOUT_SECONDS": 30.0,
    # A database call still running after this long logs one warning
    # (database.stall_watch).
    "DATABASE_STALL_WARNING_SECONDS": 5.0,
}

# A placeholder that must never reach production.
DEV_SECRET_KEY = "dev-insecure-secret-key"


class ConfigError(Exception):
    """The configuration cannot be used; the message names what and where."""


# Numeric settings: (type, smallest allowed value).
# Each is finite: nan passed every "at least" check (nan < x is false) and
# made the worker spin or never lease; inf slept for ever or overflowed.
NUMERIC_SETTINGS: dict[str, tuple[type, float]] = {
    "MAX_BODY_BYTES": (int, 1),
    "IDEMPOTENCY_LEASE_SECONDS": (int, 1),
    "IDEMPOTENCY_TTL_SECONDS": (int, 1),
    "IDEMPOTENCY_LOCK_TIMEOUT_SECONDS": (float, 0.001),
    "PURGE_BATCH_SIZE": (int, 1),
    "API_RETENTION_DAYS": (int, 1),
    "DEFAULT_RETENTION_DAYS": (int, 1),
    "TRUSTED_PROXIES": (int, 0),
    "ADMIN_SESSION_HOURS": (float, 0.01),
    "ADMIN_LOGIN_MAX_FAILURES": (int, 1),
    "ADMIN_LOGIN_WINDOW_SECONDS": (int, 1),
    "ADMIN_PAGE_SIZE": (int, 1),
    "DUPLICATE_FLUSH_SECONDS": (float, 0),
    "REJECTION_FLUSH_SECONDS": (float, 0),
    "WORKER_LEASE_SECONDS": (float, 0.1),
    "WORKER_POLL_SECONDS": (float, 0.001),
    "WORKER_MAX_ATTEMPTS": (int, 1),
    "WORKER_BACKOFF_BASE_SECONDS": (float, 0),
    "WORKER_BACKOFF_MAX_SECONDS": (float, 0),
    "WORKER_RETRY_AFTER_MAX_SECONDS": (float, 0),
    "WORKER_THREADS": (int, 1),
    "DATABASE_STATEMENT_TIMEOUT_SECONDS": (float, 0),
    "DATABASE_STALL_WARNING_SECONDS": (float, 0.001),
}
# Caps where inf means "no cap" (the backoff keeps a delay within a century).
UNCAPPED_ALLOWED = frozenset({"WORKER_BACKOFF_MAX_SECONDS", "WORKER_RETRY_AFTER_MAX_SECONDS"})

HOUR = 3600
DAY = 24 * HOUR
YEAR = 365 * DAY
CENTURY_DAYS = 36_500
# PostgreSQL keeps statement_timeout and lock_timeout in a 32-bit count of
# milliseconds: a larger one fails every connection (or the claim's write).
POSTGRESQL_TIMEOUT_SECONDS = 2_147_483

# Numeric settings' largest allowed values, and why. A huge finite value
# otherwise passed startup and crashed at first use: a timedelta or a date
# past year 9999 (OverflowError, a 500 at login), a sleep or wait beyond
# threading.TIMEOUT_MAX, a timeout PostgreSQL refuses, a LIMIT past 64 bits.
NUMERIC_MAXIMA: dict[str, tuple[float, str]] = {
    "MAX_BODY_BYTES": (1024**3, "1 GiB: PostgreSQL's largest field value"),
    "IDEMPOTENCY_LEASE_SECONDS": (DAY, "1 day: no request runs longer"),
    "IDEMPOTENCY_TTL_SECONDS": (CENTURY_DAYS * DAY, "a century: its expiry stays a date"),
    "IDEMPOTENCY_LOCK_TIMEOUT_SECONDS": (
        POSTGRESQL_TIMEOUT_SECONDS,
        "PostgreSQL's limit for lock_timeout",
    ),
    "PURGE_BATCH_SIZE": (1_000_000, "rows deleted in one transaction"),
    "API_RETENTION_DAYS": (CENTURY_DAYS, "a century: its cutoff stays a date"),
    "DEFAULT_RETENTION_DAYS": (CENTURY_DAYS, "a century: its cutoff stays a date"),
    "TRUSTED_PROXIES": (100, "no deployment chains more proxies"),
    "ADMIN_SESSION_HOURS": (365 * 24, "1 year: a session's end stays a date"),
    "ADMIN_LOGIN_MAX_FAILURES": (1_000_000, "a limit that still limits guessing"),
    "ADMIN_LOGIN_WINDOW_SECONDS": (YEAR, "1 year: the window's start stays a date"),
    "ADMIN_PAGE_SIZE": (10_000, "rows one admin page renders at once"),
    "DUPLICATE_FLUSH_SECONDS": (DAY, "1 day: counts wait in memory that long"),
    "REJECTION_FLUSH_SECONDS": (DAY, "1 day: counts wait in memory that long"),
    "WORKER_LEASE_SECONDS": (7 * DAY, "1 week: above twice a forward's longest timeout"),
    "WORKER_POLL_SECONDS": (DAY, "1 day: new deliveries wait that long"),
    "WORKER_MAX_ATTEMPTS": (1_000_000, "far within the 32-bit count of attempts"),
    "WORKER_BACKOFF_BASE_SECONDS": (YEAR, "1 year: a first retry any later is none"),
    # Any cap is safe (inf is none): the backoff keeps each delay within a
    # century, so that 1e15 ("honour any Retry-After") is as good as inf.
    "WORKER_BACKOFF_MAX_SECONDS": (math.inf, "none: a delay stays within a century"),
    "WORKER_RETRY_AFTER_MAX_SECONDS": (math.inf, "none: a delay stays within a century"),
    # PostgreSQL's pool is 5 + 5 connections; the claim loop holds one.
    "WORKER_THREADS": (9, "each needs one of the pool's 10 connections"),
    "DATABASE_STATEMENT_TIMEOUT_SECONDS": (
        POSTGRESQL_TIMEOUT_SECONDS,
        "PostgreSQL's limit for statement_timeout",
    ),
    "DATABASE_STALL_WARNING_SECONDS": (DAY, "1 day: a call stalled longer is long dead"),
}


def check_positive_integer(
    value: Any, key: str, where: str, maxima: dict[str, tuple[int, str]]
) -> None:
    """ConfigError unless ``value`` is a positive integer (not a bool) within ``maxima[key]``."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where} {key} must be a positive integer")
    largest, why = maxima[key]
    if value > largest:
        raise ConfigError(f"{where} {key} must be from 1 to {largest:,} ({why}), got {value}")


# Boolean settings. Flask reads "true", "false", "1" and "0" as JSON, but
# "no", "False" or "off" stayed a string, which Python counts true.
BOOLEAN_SETTINGS = frozenset(
    {"SESSION_COOKIE_SECURE", "TRANSACTION_POOLER", "FORCE_SHORT_RETENTION", "WORKER_ATTEMPT_LOG"}
)
_BOOLEAN_WORDS = {"true": True, "yes": True, "on": True, "1": True}
_BOOLEAN_WORDS |= {"false": False, "no": False, "off": False, "0": False}


def _boolean(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    if isinstance(value, int) and value in (0, 1):
        word = str(value)
    if word not in _BOOLEAN_WORDS:
        raise ConfigError(
            f"WEBHOOK_RECEIVER_{name} must be true or false (or yes/no, on/off, 1/0), got {value!r}"
        )
    return _BOOLEAN_WORDS[word]


PREFIX = "WEBHOOK_RECEIVER_"
# The names read under the prefix: the receiver's settings, its TOML file,
# and (as the README says) Flask's and its extensions' own settings.
ENVIRONMENT_NAMES = frozenset(
    {
        *DEFAULTS,
        "CONFIG",
        *Flask.default_config,
        "SQLALCHEMY_BINDS",
        "SQLALCHEMY_ECHO",
        "SQLALCHEMY_RECORD_QUERIES",
        "SQLALCHEMY_TRACK_MODIFICATIONS",
        "WTF_CSRF_ENABLED",
        "WTF_CSRF_FIELD_NAME",
        "WTF_CSRF_HEADERS",
        "WTF_CSRF_METHODS",
        "WTF_CSRF_SECRET_KEY",
        "WTF_CSRF_SSL_STRICT",
        "WTF_CSRF_TIME_LIMIT",
    }
    # The app sets these itself, over any value given.
    - {"MAX_CONTENT_LENGTH", "SESSION_COOKIE_SAMESITE"}
)
# Names taken for another's, and the variable meant.
_MEANT = {
    "DATABASE_URL": "DATABASE_URL",
    "SQLALCHEMY_DATABASE_URI": "DATABASE_URL",
    "MAX_CONTENT_LENGTH": PREFIX + "MAX_BODY_BYTES",
}


def check_environment_names(environ: Mapping[str, str]) -> None:
    """Refuse a ``WEBHOOK_RECEIVER_*`` variable the receiver does not read (a typo, mostly).

    Flask's ``from_prefixed_env`` takes each into the config, where nobody
    reads a misspelled one. ``A__B`` nests B in the setting A, as Flask does.
    """
    for variable in sorted(environ):
        if not variable.startswith(PREFIX):
            continue
        name, nested, _ = variable[len(PREFIX) :].partition("__")
        if name in ENVIRONMENT_NAMES:
            default = DEFAULTS.get(name, Flask.default_config.get(name, {}))
            if nested and not isinstance(default, dict):
                # Flask would set a key inside a number or a string (a TypeError).
                raise ConfigError(
                    f"{variable}: {PREFIX}{name} is not a table of settings: "
                    f"set {PREFIX}{name} itself"
                )
            continue
        meant = _MEANT.get(name)
        if meant is None:
            close = difflib.get_close_matches(name, sorted(ENVIRONMENT_NAMES), n=1)
            meant = PREFIX + close[0] if close else None
        hint = f": did you mean {meant}?" if meant else ""
        # The value is never shown: it may be a password or a token.
        raise ConfigError(f"{variable} is not a setting the receiver reads{hint}")


def check_settings(config: dict[str, Any]) -> None:
    """Coerce the numeric and boolean settings in place, or say which one is wrong and how.

    The environment's names are checked before (check_environment_names, by create_app).
    """
    for name in sorted(BOOLEAN_SETTINGS & set(config)):
        config[name] = _boolean(name, config[name])
    for name, (kind, smallest) in NUMERIC_SETTINGS.items():
        if name not in config:
            continue
        value = config[name]
        try:
            if isinstance(value, bool):
                raise ValueError
            # int(2.5) is 2: a fraction is refused, not truncated.
            if kind is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            number = kind(value)
        except (TypeError, ValueError, OverflowError):  # int(inf) overflows
            raise ConfigError(
                f"WEBHOOK_RECEIVER_{name} must be a{'n integer' if kind is int else ' number'}, "
                f"got {value!r}"
            ) from None
        largest, why = NUMERIC_MAXIMA[name]
        if math.isnan(number) or (math.isinf(number) and name not in UNCAPPED_ALLOWED):
            allowed = (
                f"of at least {smallest:g}, or inf ({why})"
                if math.isinf(largest)
                else f"from {smallest:g} to {int(largest):,} ({why})"
            )
            raise ConfigError(
                f"WEBHOOK_RECEIVER_{name} must be a finite number {allowed}, got {value!r}"
            )
        if number < smallest or number > largest:
            # The whole range, whichever end was passed.
            allowed = (
                f"at least {smallest:g} ({why})"
                if math.isinf(largest)
                else f"from {smallest:g} to {int(largest):,} ({why})"
            )
            raise ConfigError(f"WEBHOOK_RECEIVER_{name} must be {allowed}, got {value!r}")
        config[name] = number


def database_uri(url: str | None, instance_path: str) -> str:
    """Turn ``DATABASE_URL`` into a SQLAlchemy URI; default to SQLite in the instance folder."""
    if not url:
        return "sqlite:///" + os.path.join(instance_path, "webhook_receiver.sqlite3")
    given = url
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix) :]
    # Refused here, in one line, rather than by SQLAlchemy as a traceback when
    # the app starts (or, under the flask CLI, as "No such command"). A port
    # that is no number is a ValueError.
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        raise ConfigError(
            f"DATABASE_URL {redact_url(given)!r} is not a database URL: "
            "give postgresql://user:password@host/name or sqlite:////path/to/file"
        ) from None
    if (parsed.get_backend_name(), parsed.get_driver_name()) not in _DRIVERS:
        raise ConfigError(
            f"DATABASE_URL {redact_url(given)!r}: the receiver runs on PostgreSQL "
            "(postgresql://, through psycopg 3) or SQLite (sqlite:///), no other database"
        )
    return url


# The databases the receiver's SQL is written for, through the drivers it ships.
_DRIVERS = {("postgresql", "psycopg"), ("sqlite", "pysqlite")}


def url_problem(url: str) -> str | None:
    """What keeps a broker or forward URL from connecting, said after its key; None if nothing.

    urllib's own checks, which pika, nats-py, redis-py and the MQTT and HTTP
    clients parse with: a stray '[' or ']' ("Invalid IPv6 URL"), a port that
    is no number or out of range. Port 0 reaches no server either. The URL is
    never quoted: a password with a '/' in it is read as host and port.
    """
    try:
        parts = urlsplit(url)
        parts.hostname  # noqa: B018  (raises ValueError for a bad bracketed host)
    except ValueError:
        return "must hold '[' and ']' only around an IPv6 host ([::1]), percent-encoded elsewhere"
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        return "must have a port from 1 to 65535 (or none, for the scheme's default)"
    return None


def redact_url(url: str) -> str:
    """The URL with any password, lone user part and query replaced by [redacted].

    A user part without a password is a token for NATS (``nats://TOKEN@host``)
    and for many HTTP APIs; queries carry tokens too.
    """
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        host = netloc.rpartition("@")[2]
        if parts.password is not None:
            netloc = f"{parts.username or ''}:[redacted]@{host}"
        elif "@" in netloc:
            netloc = f"[redacted]@{host}"
        query = "[redacted]" if parts.query else ""
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "[unparsable URL]"
