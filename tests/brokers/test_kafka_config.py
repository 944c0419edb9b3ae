"""Kafka sources' configuration: the issue's shape, its refusals, and Azure Event Hubs.

There is no Event Hubs to test against here (nor any network beyond this
machine): its source is checked as configuration, and its connection string
(the SASL password) is looked for, and never found, in reprs, the admin's
pages and a consumer's logs while it fails to reach a broker on loopback.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from webhook_receiver.brokers import runner
from webhook_receiver.brokers.kafka import client_settings
from webhook_receiver.config import ConfigError, parse

from ..admin.conftest import PASSWORD, login
from .conftest import free_port, wait_until

CONNECTION_STRING = (
    "Endpoint=sb://wr-example.servicebus.windows.net/;SharedAccessKeyName=consume;"
    "SharedAccessKey=c2VjcmV0LWtleS10aGF0LW11c3QtbmV2ZXItbGVhaw="
)
SECRET = "c2VjcmV0LWtleS10aGF0LW11c3QtbmV2ZXItbGVhaw="


def event_hubs(bootstrap: str = "wr-example.servicebus.windows.net:9093") -> dict[str, Any]:
    """docs/brokers.md's Event Hubs source."""
    return {
        "provider": "kafka",
        "bootstrap_servers": bootstrap,
        "topics": ["orders"],
        "group_id": "webhook-receiver-orders",
        "dedup_key": "header:message-id",
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "PLAIN",
        "sasl_username": "$ConnectionString",
        "sasl_password": CONNECTION_STRING,
    }


def _parse(table: dict[str, Any]) -> Any:
    return parse({"sources": {"hub": table}}, providers=["github"])


def test_the_issues_source_is_accepted_with_its_defaults():
    config = _parse(
        {
            "provider": "kafka",
            "bootstrap_servers": "127.0.0.1:9092",
            "topics": ["orders"],
            "dedup_key": "header:message-id",
        }
    )
    source = config.brokers["hub"]
    assert (source.group_id, source.offsets, source.batch, source.event_type) == (
        "webhook-receiver-hub",
        "inbox",
        500,
        "",
    )
    assert source.dead_letter_topic is None
    assert source.safe_url == "kafka://127.0.0.1:9092"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"dedup_key": None}, "dedup_key is required"),
        ({"dedup_key": "property:message_id"}, "dedup_key"),
        ({"dedup_key": "topic"}, "event type"),
        ({"event_type": "offset"}, "dedup key"),
        ({"event_type": "subject"}, "event_type"),
        ({"offsets": "zookeeper"}, "offsets must be"),
        ({"topics": []}, "topics must be"),
        ({"topics": ["a b"]}, "topics must be"),
        ({"bootstrap_servers": "kafka://127.0.0.1"}, "bootstrap_servers"),
        ({"dead_letter_topic": "orders"}, "among topics"),
        ({"batch": 0}, "batch must be"),
        ({"url": "kafka://127.0.0.1:9092"}, "unknown key"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_password": "x"}, "go together"),
        ({"sasl_username": "u", "sasl_password": "x"}, "needs security_protocol"),
        ({"sasl_mechanism": "MD5"}, "sasl_mechanism"),
    ],
)
def test_a_kafka_source_that_cannot_work_is_refused(change, says):
    table = {
        "provider": "kafka",
        "bootstrap_servers": "127.0.0.1:9092",
        "topics": ["orders"],
        "dedup_key": "header:message-id",
    }
    table.update(change)
    table = {k: v for k, v in table.items() if v is not None}
    with pytest.raises(ConfigError, match=says):
        _parse(table)


def test_every_spec_of_the_issue_is_accepted():
    for dedup_key in ("header:message-id", "key", "json:/id", "offset"):
        for event_type in ("header:type", "json:/type", "topic"):
            table = {**event_hubs(), "dedup_key": dedup_key, "event_type": event_type}
            assert _parse(table).brokers["hub"].dedup_key == dedup_key


def test_event_hubs_is_accepted_and_its_connection_string_is_never_shown():
    config = _parse(event_hubs())
    source = config.brokers["hub"]
    settings = client_settings(source)
    assert settings["security.protocol"] == "SASL_SSL"
    assert settings["sasl.mechanisms"] == "PLAIN"
    assert settings["sasl.username"] == "$ConnectionString"
    assert settings["sasl.password"] == CONNECTION_STRING  # handed to librdkafka, and only there
    for shown in (repr(source), str(source), repr(config), source.safe_url):
        assert SECRET not in shown and "SharedAccessKey" not in shown, shown
    assert "wr-example.servicebus.windows.net:9093" in repr(source)


def test_the_connection_string_is_in_no_admin_page(make_app):
    app = make_app({"sources": {"hub": event_hubs()}}, ADMIN_PASSWORD=PASSWORD)
    client = app.test_client()
    assert login(client).status_code == 302
    for path in ("/admin/", "/admin/events", "/admin/events?source=hub", "/admin/rejections"):
        page = client.get(path)
        assert page.status_code == 200, path
        text = page.get_data(as_text=True)
        assert SECRET not in text and "SharedAccessKey" not in text, path
    # The pages know the source: its name is among the events page's sources.
    assert '<option value="hub">' in client.get("/admin/events").get_data(as_text=True)


def test_the_connection_string_is_in_no_log_line_of_a_consumer(make_app, caplog, capfd):
    # SASL_SSL to a closed loopback port: the consumer fails to connect and
    # says so; every line of the process, librdkafka's on stderr too, is read.
    table = event_hubs(f"127.0.0.1:{free_port()}")
    app = make_app({"sources": {"hub": table}})
    source = app.config["FILE_CONFIG"].brokers["hub"]
    caplog.set_level(logging.DEBUG)
    stop = threading.Event()
    consumer = runner.consumer_for(app, source, stop)
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: "broker unavailable" in caplog.text, 30), caplog.text
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    out, err = capfd.readouterr()
    for text in (caplog.text, out, err):
        assert SECRET not in text and "SharedAccessKey" not in text
    assert "kafka://127.0.0.1:" in caplog.text  # the line names where it tried
