"""Configuration: defaults, then the environment, then the TOML file.

Split by concern: ``settings`` (defaults, the environment's numbers, the
database URL, ``ConfigError``), ``checks`` (the secret key and retention at
start-up), ``loader`` (the TOML file into ``FileConfig``), ``sources``
(webhook sources), ``brokers`` (broker sources), ``forwards`` (forwards and
ordering rules) and ``signing`` (the HMAC scheme's grammar and secrets'
forms). The names other layers use are re-exported here.
"""

from __future__ import annotations

from .brokers import (
    AMQP_PROPERTIES,
    BROKER_PROVIDERS,
    PER_DELIVERY,
    BrokerSourceConfig,
    parse_broker_spec,
    subject_covers,
)
from .checks import SECRET_KEY_FILE, check_retention, check_secret_key
from .forwards import CONSUMER_NAME, ForwardConfig, OrderingConfig
from .loader import ClientConfig, FileConfig, load_file, load_for_app, parse
from .settings import (
    DEFAULTS,
    DEV_SECRET_KEY,
    MIN_RETENTION_DAYS,
    NUMERIC_MAXIMA,
    NUMERIC_SETTINGS,
    ConfigError,
    check_environment_names,
    check_settings,
    database_uri,
    redact_url,
)
from .signing import (
    BASE64_SECRET_PREFIX,
    HMAC_ALGORITHMS,
    HMAC_ENCODINGS,
    HMAC_SCHEME_KEYS,
    SIGNED_PLACEHOLDERS,
    signed_content_parts,
)
from .sources import SourceConfig, parse_spec

__all__ = [
    "AMQP_PROPERTIES",
    "BASE64_SECRET_PREFIX",
    "BROKER_PROVIDERS",
    "CONSUMER_NAME",
    "DEFAULTS",
    "DEV_SECRET_KEY",
    "HMAC_ALGORITHMS",
    "HMAC_ENCODINGS",
    "HMAC_SCHEME_KEYS",
    "MIN_RETENTION_DAYS",
    "NUMERIC_MAXIMA",
    "NUMERIC_SETTINGS",
    "PER_DELIVERY",
    "SECRET_KEY_FILE",
    "SIGNED_PLACEHOLDERS",
    "BrokerSourceConfig",
    "ClientConfig",
    "ConfigError",
    "FileConfig",
    "ForwardConfig",
    "OrderingConfig",
    "SourceConfig",
    "check_environment_names",
    "check_retention",
    "check_secret_key",
    "check_settings",
    "database_uri",
    "load_file",
    "load_for_app",
    "parse",
    "parse_broker_spec",
    "parse_spec",
    "redact_url",
    "signed_content_parts",
    "subject_covers",
]
