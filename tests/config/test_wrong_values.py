"""Wrong values in the config file, the environment and the TOML bytes: one line each."""

from __future__ import annotations

import json

import pytest

from webhook_receiver import create_app
from webhook_receiver.config import NUMERIC_SETTINGS, ConfigError, load_file, parse
from webhook_receiver.webhooks.providers import PROVIDERS


def _start(raw: dict) -> None:
    create_app({"TESTING": True, "RECEIVER_CONFIG": raw})


@pytest.mark.parametrize("provider", [["kafka"], {"name": "kafka"}, 5])
def test_a_provider_that_is_no_string_is_refused_naming_the_source(provider):
    # A list or a table was looked up in the set of broker providers: a
    # TypeError (unhashable type) and a traceback instead of one line.
    with pytest.raises(ConfigError, match=r"\[sources\.orders\] provider must be one of .*kafka"):
        _start({"sources": {"orders": {"provider": provider}}})


# -- the TOML file's bytes ----------------------------------------------------


def _start_file(monkeypatch: pytest.MonkeyPatch, path) -> None:
    monkeypatch.setenv("WEBHOOK_RECEIVER_CONFIG", str(path))
    create_app({"TESTING": True})


def test_a_toml_file_not_in_utf8_is_one_line_naming_the_file_and_line(
    instance, tmp_path, monkeypatch
):
    # A Latin-1 file (an editor's default) raised UnicodeDecodeError: a traceback.
    path = tmp_path / "latin1.toml"
    path.write_bytes('[clients.acme]\n# café\ntoken = "0123456789abcdef"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        _start_file(monkeypatch, path)
    message = str(info.value)
    assert message == f"{path}: not UTF-8 at line 2: save the file as UTF-8"


def test_a_toml_file_with_a_byte_order_mark_says_so(instance, tmp_path, monkeypatch):
    # It said "not valid TOML: Invalid statement (at line 1, column 1)", of a
    # line that looks right in every editor.
    path = tmp_path / "bom.toml"
    path.write_bytes(b'\xef\xbb\xbf[clients.acme]\ntoken = "0123456789abcdef"\n')
    with pytest.raises(ConfigError) as info:
        _start_file(monkeypatch, path)
    assert str(info.value) == (
        f"{path}: starts with a byte-order mark (BOM): save the file as UTF-8 without one"
    )


# -- booleans from the environment --------------------------------------------

BOOLEANS = ["FORCE_SHORT_RETENTION", "SESSION_COOKIE_SECURE", "TRANSACTION_POOLER"]
BOOLEANS += ["WORKER_ATTEMPT_LOG"]
SHORT = {
    "sources": {
        "shop": {"provider": "generic", "secrets": ["s"], "signature_header": "X-Sig"}
        | {"retention_days": 1}
    }
}


@pytest.mark.parametrize("value", ["no", "No", "False", "FALSE", "off", " false ", "0"])
def test_force_short_retention_written_no_or_false_does_not_force(monkeypatch, value):
    # Flask reads "false" and "0" as JSON; "no", "False" or "off" stayed a
    # string, which is true: a 1-day retention was taken without the force.
    monkeypatch.setenv("WEBHOOK_RECEIVER_FORCE_SHORT_RETENTION", value)
    with pytest.raises(ConfigError, match="retention_days = 1 is shorter"):
        _start(SHORT)


@pytest.mark.parametrize("name", BOOLEANS)
@pytest.mark.parametrize(
    ("value", "expected"),
    [("yes", True), ("On", True), ("TRUE", True), ("1", True), ("no", False), ("Off", False)],
)
def test_boolean_settings_read_yes_no_on_off_any_case(monkeypatch, name, value, expected):
    monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", value)
    app = create_app({"TESTING": True, "RECEIVER_CONFIG": {}})
    assert app.config[name] is expected


@pytest.mark.parametrize("name", BOOLEANS)
@pytest.mark.parametrize("value", ["maybe", "2", "[]", ""])
def test_a_boolean_setting_neither_true_nor_false_is_refused_naming_it(monkeypatch, name, value):
    monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", value)
    with pytest.raises(ConfigError) as info:
        create_app({"TESTING": True, "RECEIVER_CONFIG": {}})
    assert str(info.value).startswith(
        f"WEBHOOK_RECEIVER_{name} must be true or false (or yes/no, on/off, 1/0), got "
    )


# -- numbers from the environment ---------------------------------------------

INT_SETTINGS = sorted(name for name, (kind, _) in NUMERIC_SETTINGS.items() if kind is int)


@pytest.mark.parametrize("name", INT_SETTINGS)
def test_an_integer_setting_with_a_fraction_is_refused_not_truncated(monkeypatch, name):
    # int(2.5) is 2: WORKER_MAX_ATTEMPTS=2.5 ran with 2 attempts, and
    # TRUSTED_PROXIES=0.5 with none, without a word.
    monkeypatch.setenv(f"WEBHOOK_RECEIVER_{name}", "2.5")
    with pytest.raises(ConfigError) as info:
        create_app({"TESTING": True, "RECEIVER_CONFIG": {}})
    assert str(info.value) == f"WEBHOOK_RECEIVER_{name} must be an integer, got 2.5"


@pytest.mark.parametrize(("value", "expected"), [(" 7 ", 7), ("7.0", 7), ("1e1", 10)])
def test_an_integer_setting_written_with_spaces_or_as_a_whole_float_is_read(
    monkeypatch, value, expected
):
    monkeypatch.setenv("WEBHOOK_RECEIVER_WORKER_MAX_ATTEMPTS", value)
    app = create_app({"TESTING": True, "RECEIVER_CONFIG": {}})
    assert app.config["WORKER_MAX_ATTEMPTS"] == expected
    assert type(app.config["WORKER_MAX_ATTEMPTS"]) is int


# -- URLs ---------------------------------------------------------------------

SQS_QUEUE = "https://sqs.eu-west-1.amazonaws.com/123456789012/jobs"


@pytest.mark.parametrize(
    ("key", "table"),
    [
        ("queue_url", {"queue_url": "https://[sqs.eu-west-1/123456789012/jobs"}),
        (
            "dead_letter_queue_url",
            {"queue_url": SQS_QUEUE, "dead_letter_queue_url": "https://[x/1/d"},
        ),
        ("endpoint_url", {"queue_url": SQS_QUEUE, "endpoint_url": "http://[localhost:4566"}),
    ],
)
def test_an_sqs_url_with_an_unclosed_bracket_is_refused_naming_the_key(key, table):
    # urlsplit raised ValueError ("Invalid IPv6 URL"): a traceback.
    with pytest.raises(ConfigError, match=rf"\[sources\.jobs\] {key} must be "):
        _start({"sources": {"jobs": {"provider": "sqs", **table}}})


# -- source names -------------------------------------------------------------

GENERIC = {"provider": "generic", "secrets": ["s"], "signature_header": "X-Sig"}


def test_two_source_names_differing_only_in_case_are_refused():
    # [sources.Orders] beside [sources.orders] (a typo) made two endpoints,
    # two event sources and two retention rules, without a word.
    rabbit = {"provider": "rabbitmq", "url": "amqp://127.0.0.1", "queue": "q"}
    with pytest.raises(ConfigError) as info:
        _start({"sources": {"orders": GENERIC, "Orders": rabbit}})
    assert str(info.value) == (
        "<test config>: [sources.Orders] and [sources.orders] differ only in case: "
        "rename one (they would be two sources)"
    )


@pytest.mark.parametrize("name", [".", "..", "a\nb", "tab\there", " "])
def test_a_source_name_no_url_can_carry_is_refused(name):
    # /webhooks/.. is /, a control character ends up raw in log lines.
    with pytest.raises(ConfigError, match="is not a usable source name"):
        _start({"sources": {name: GENERIC}})


# -- DATABASE_URL -------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:s3cr3t-pw@db.example:badport/app",
        "postgres://app:s3cr3t-pw@[::1/app",
    ],
)
def test_a_database_url_that_does_not_parse_is_one_line_without_its_password(
    instance, monkeypatch, url
):
    # A port that is no number raised ValueError from SQLAlchemy's URL parser:
    # a traceback instead of the one line naming DATABASE_URL.
    monkeypatch.setenv("DATABASE_URL", url)
    with pytest.raises(ConfigError) as info:
        create_app({"TESTING": True, "RECEIVER_CONFIG": {}})
    message = str(info.value)
    assert message.startswith("DATABASE_URL ")
    assert "is not a database URL" in message
    assert "s3cr3t" not in message


# -- forwards and broker sources ----------------------------------------------


def test_a_forward_with_an_empty_event_types_list_is_refused():
    # event_types = [] matched no event: a forward that never forwards, taken
    # without a word (leaving the key out forwards every type).
    forward = {"name": "crm", "url": "http://127.0.0.1:9/x", "event_types": []}
    with pytest.raises(ConfigError) as info:
        _start({"sources": {"shop": GENERIC | {"forward": [forward]}}})
    assert str(info.value) == (
        "<test config>: [[sources.shop.forward]] crm: event_types must be a non-empty list "
        "of event type names (leave it out for every type)"
    )


KAFKA = {
    "provider": "kafka",
    "bootstrap_servers": "127.0.0.1:9092",
    "topics": ["orders"],
    "dedup_key": "key",
}


@pytest.mark.parametrize(
    ("extra", "needs"),
    [
        (
            {"ssl_ca_location": "/etc/ca.pem"},
            "ssl_ca_location needs security_protocol SSL or SASL_SSL",
        ),
        (
            {"sasl_mechanism": "PLAIN"},
            "sasl_mechanism needs security_protocol SASL_SSL or SASL_PLAINTEXT",
        ),
    ],
)
def test_a_kafka_source_setting_its_protocol_ignores_is_refused(extra, needs):
    # With the default PLAINTEXT, librdkafka never read them: no TLS check of
    # the broker, no sign-in, and no word of it.
    with pytest.raises(ConfigError) as info:
        _start({"sources": {"orders": KAFKA | extra}})
    assert str(info.value) == f"<test config>: [sources.orders] {needs}"


# -- broker and forward URLs that cannot connect ------------------------------

RABBIT = {"provider": "rabbitmq", "queue": "q"}
PORTS = "must have a port from 1 to 65535 (or none, for the scheme's default)"
BRACKETS = "must hold '[' and ']' only around an IPv6 host ([::1]), percent-encoded elsewhere"


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (RABBIT | {"url": "amqp://h:abc"}, f"url {PORTS}"),
        (RABBIT | {"url": "amqp://app:s3cr3t@h:99999/"}, f"url {PORTS}"),
        (RABBIT | {"url": "amqp://h:0"}, f"url {PORTS}"),
        ({"provider": "mqtt", "url": "mqtt://[x", "topics": ["t"]}, f"url {BRACKETS}"),
        ({"provider": "redis", "url": "redis://h:65536", "stream": "s"}, f"url {PORTS}"),
        (
            {"provider": "nats", "url": "nats://app:s3cr3t@h:4x22", "stream": "s"},
            f"url {PORTS}",
        ),
        (
            KAFKA | {"bootstrap_servers": "127.0.0.1:9092,127.0.0.1:0"},
            "bootstrap_servers must be 'host:port', comma-separated, each port from 1 to 65535",
        ),
        (
            KAFKA | {"bootstrap_servers": "127.0.0.1:99999"},
            "bootstrap_servers must be 'host:port', comma-separated, each port from 1 to 65535",
        ),
        (
            {"provider": "sqs", "queue_url": SQS_QUEUE, "endpoint_url": "http://localhost:99999"},
            "endpoint_url must be an http:// or https:// URL",
        ),
    ],
)
def test_a_broker_source_url_that_cannot_connect_is_refused_at_start(table, expected):
    # Each passed the check and failed only when flask consume connected
    # (pika, nats-py, librdkafka: a ValueError or a broker that never answers).
    with pytest.raises(ConfigError) as info:
        _start({"sources": {"orders": table}})
    assert str(info.value) == f"<test config>: [sources.orders] {expected}"
    assert "s3cr3t" not in str(info.value)


@pytest.mark.parametrize(
    ("forward", "expected"),
    [
        ({"url": "http://h:99999/"}, f"url {PORTS}"),
        ({"url": "https://app:s3cr3t@h:abc/in"}, f"url {PORTS}"),
        ({"url": "http://[::1/in"}, f"url {BRACKETS}"),
        ({"url": "amqp://app:s3cr3t@h:abc", "routing_key": "r"}, f"url {PORTS}"),
        ({"url": "nats://h:0", "subject": "s"}, f"url {PORTS}"),
        ({"url": "redis://h:70000", "stream": "s"}, f"url {PORTS}"),
        ({"url": "mqtt://[x", "topic": "t"}, f"url {BRACKETS}"),
        (
            {"url": "kafka://127.0.0.1:9092,127.0.0.1:99999", "topic": "t"},
            "url must be kafka://host:port, with more brokers after commas "
            "(kafka://host1:9092,host2:9092), each port from 1 to 65535",
        ),
        (
            {"url": "kafka://app:s3cr3t@127.0.0.1:0", "topic": "t"},
            "url must be kafka://host:port, with more brokers after commas "
            "(kafka://host1:9092,host2:9092), each port from 1 to 65535",
        ),
        (
            {"url": "sqs://localhost:99999/000000000000/jobs", "region": "eu-west-1"},
            f"url {PORTS}",
        ),
        (
            {
                "url": "sqs://sqs.eu-west-1.amazonaws.com/000000000000/jobs",
                "endpoint_url": "http://localhost:0",
            },
            "endpoint_url must be an http:// or https:// URL (no path)",
        ),
    ],
)
def test_a_forward_url_that_cannot_connect_is_refused_at_start(forward, expected):
    # Each passed the check; the worker failed every attempt at connecting.
    table = GENERIC | {"forward": [{"name": "crm", **forward}]}
    with pytest.raises(ConfigError) as info:
        _start({"sources": {"shop": table}})
    assert str(info.value) == f"<test config>: [[sources.shop.forward]] crm: {expected}"
    assert "s3cr3t" not in str(info.value)


@pytest.mark.parametrize(
    "url", ["amqp://h", "amqp://h:5672/%2F", "amqp://[::1]:5672", "amqp://u:p%5Bw@h:1"]
)
def test_a_broker_url_with_a_usable_port_or_none_is_still_taken(url):
    _start({"sources": {"orders": RABBIT | {"url": url}}})


# -- names alike but for case -------------------------------------------------


def test_two_client_names_differing_only_in_case_are_refused():
    # [clients.Acme] beside [clients.acme] made two event sources, api:Acme
    # and api:acme, each with its own forwards, without a word.
    clients = {"acme": {"token": "0123456789abcdef"}, "Acme": {"token": "fedcba9876543210"}}
    with pytest.raises(ConfigError) as info:
        _start({"clients": clients})
    assert str(info.value) == (
        "<test config>: [clients.Acme] and [clients.acme] differ only in case: "
        "rename one (they would be two clients)"
    )


def test_two_forward_names_in_one_source_differing_only_in_case_are_refused():
    # Two forwards a reader takes for one, each with its own deliveries and
    # breaker, without a word.
    forwards = [{"name": "crm", "url": "http://127.0.0.1:9/a"}]
    forwards.append({"name": "CRM", "url": "http://127.0.0.1:9/b"})
    with pytest.raises(ConfigError) as info:
        _start({"sources": {"shop": GENERIC | {"forward": forwards}}})
    assert str(info.value) == (
        "<test config>: [[sources.shop.forward]] forwards 'crm' and 'CRM' differ only in "
        "case: rename one (they would be two forwards)"
    )


def test_one_forward_name_in_two_sources_is_still_taken():
    forward = {"name": "crm", "url": "http://127.0.0.1:9/a"}
    _start({"sources": {"shop": GENERIC | {"forward": [forward]}, "Crm": GENERIC}})
    other = GENERIC | {"forward": [forward | {"name": "CRM"}]}
    _start({"sources": {"shop": GENERIC | {"forward": [forward]}, "other": other}})


# -- handlers -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["", " ", "my app.handlers", ".handlers", "app..x", "app/x.py"])
def test_a_handler_name_that_is_no_module_path_is_refused_at_load(tmp_path, name):
    # It passed loading and failed only when the handlers were imported.
    path = tmp_path / "receiver.toml"
    path.write_text(f"handlers = [{json.dumps(name)}]\n")
    with pytest.raises(ConfigError) as info:
        load_file(path, required=True, providers=PROVIDERS)
    assert str(info.value) == (
        f"{path}: handlers must be a list of Python module paths (myapp.handlers), got {name!r}"
    )


def test_a_dotted_handler_module_path_is_still_taken():
    config = parse({"handlers": ["myapp.handlers", "_private2.x"]}, providers=PROVIDERS)
    assert config.handlers == ("myapp.handlers", "_private2.x")


def test_a_handler_module_listed_twice_is_refused_naming_it():
    # Each of its handlers was collected twice, and the start said a source
    # "has two consumers named 'ledger'", not which module repeated.
    with pytest.raises(ConfigError) as info:
        parse({"handlers": ["myapp.handlers", "other", "myapp.handlers"]}, providers=PROVIDERS)
    assert "handlers lists 'myapp.handlers' twice" in str(info.value)
