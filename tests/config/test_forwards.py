"""Validation of forwards and ordering keys in the config file."""

from __future__ import annotations

import pytest

from webhook_receiver.config import ConfigError, ForwardConfig, OrderingConfig, parse
from webhook_receiver.webhooks.providers import PROVIDERS

SOURCE = {"provider": "generic", "secrets": ["s3cret-0123456789"], "signature_header": "X-Sig"}
TOKEN = "acme-token-0123456789abcdef"


def _parse(**source):
    return parse({"sources": {"shop": {**SOURCE, **source}}}, providers=PROVIDERS)


def test_forwards_and_ordering_of_a_source_are_read():
    config = _parse(
        forward=[
            {"name": "billing", "url": "http://127.0.0.1:9000/hooks", "timeout_seconds": 2.5},
            {
                "name": "crm",
                "url": "https://crm.example/in",
                "event_types": ["a"],
                "max_attempts": 3,
                "concurrency": 2,
            },
        ],
        version="json:/data/object/version",
        entity="json:/data/object/id",
    )
    assert config.forwards == {
        "shop": (
            ForwardConfig("billing", "http://127.0.0.1:9000/hooks", 2.5),
            ForwardConfig("crm", "https://crm.example/in", 10, ("a",), 3, concurrency=2),
        )
    }
    assert config.ordering == {"shop": OrderingConfig("/data/object/version", "/data/object/id")}
    assert "forward" not in config.sources["shop"].extra


def test_client_forwards_apply_to_its_api_source():
    config = parse(
        {"clients": {"acme": {"token": TOKEN, "forward": [{"name": "crm", "url": "http://x/"}]}}},
        providers=PROVIDERS,
    )
    assert config.forwards == {"api:acme": (ForwardConfig("crm", "http://x/"),)}


@pytest.mark.parametrize(
    ("forward", "message"),
    [
        ({"url": "http://x/"}, "name must be"),
        ({"name": "a:b", "url": "http://x/"}, "name must be"),
        ({"name": "b", "url": "ftp://x/"}, "url must be"),
        ({"name": "b", "url": "http://x/", "timeout_seconds": 0}, "timeout_seconds"),
        ({"name": "b", "url": "http://x/", "timeout_seconds": True}, "timeout_seconds"),
        ({"name": "b", "url": "http://x/", "max_attempts": 0}, "max_attempts"),
        ({"name": "b", "url": "http://x/", "event_types": "a"}, "event_types"),
        ({"name": "b", "url": "http://x/", "concurrency": 0}, "concurrency"),
        ({"name": "b", "url": "http://x/", "concurrency": True}, "concurrency"),
        ({"name": "b", "url": "http://x/", "concurrency": 1.5}, "concurrency"),
        ({"name": "b", "url": "http://x/", "headers": {}}, "unknown key"),
        # Slower than one send a day: its next send fell past the year 9999,
        # and every claim of the target's deliveries raised OverflowError.
        ({"name": "b", "url": "http://x/", "max_per_second": 1e-12}, "max_per_second"),
        ({"name": "b", "url": "http://x/", "max_per_second": 0.000009}, "max_per_second"),
    ],
)
def test_bad_forwards_are_refused(forward, message):
    with pytest.raises(ConfigError, match=message):
        _parse(forward=[forward])


def test_the_slowest_rate_limit_is_one_send_a_day():
    config = _parse(forward=[{"name": "b", "url": "http://x/", "max_per_second": 0.00001}])
    assert config.forwards["shop"][0].max_per_second == 0.00001


def test_two_forwards_of_one_name_are_refused():
    with pytest.raises(ConfigError, match="two forwards are named 'b'"):
        _parse(forward=[{"name": "b", "url": "http://x/"}, {"name": "b", "url": "http://y/"}])


def test_forward_must_be_an_array_of_tables():
    with pytest.raises(ConfigError, match="array of tables"):
        _parse(forward={"name": "b", "url": "http://x/"})


@pytest.mark.parametrize(
    "keys",
    [
        {"version": "json:/v"},
        {"entity": "json:/id"},
        {"version": "header:X-Version", "entity": "json:/id"},
    ],
)
def test_ordering_needs_both_json_pointers(keys):
    with pytest.raises(ConfigError, match="version and entity go together"):
        _parse(**keys)
