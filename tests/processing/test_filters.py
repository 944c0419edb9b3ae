"""Filters: a JMESPath expression over the event's JSON body decides which consumers get it.

Applied when the event is stored, by every intake (a webhook, the API, a
broker batch; the fast and the plain paths): an event the filter drops gets
no delivery row for that consumer. Checked when the config is loaded: a
bad expression stops the app from starting, with one line.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from webhook_receiver import create_app, inbox
from webhook_receiver.config import ConfigError
from webhook_receiver.config.filters import NOT_JSON, document, parse_filter
from webhook_receiver.processing import registry

from ..conftest import ACME_TOKEN, SECRET_KEY
from ..helpers import post_event
from ..helpers.signing import hmac_hex
from ..servers import BIN, ROOT, app_env
from .conftest import SOURCE, Clock, config_with, delivery_rows, forward

BIG = "data.amount >= `100`"
SECRET = "shop-secret-0123456789"


def _order(n: int) -> dict:
    # Even n: a big order (kept by the filter); odd n: a small one (dropped).
    return {"type": "order.paid", "data": {"n": n, "amount": 150 if n % 2 == 0 else 50}}


def _message(n: int, clock: Clock, body: bytes | None = None) -> inbox.Message:
    return inbox.Message(
        source=SOURCE,
        dedup_key=f"evt-{n}",
        fingerprint="f" * 64,
        body=json.dumps(_order(n)).encode() if body is None else body,
        event_type="order.paid",
        content_type="application/json",
        received_at=clock(),
    )


def _app(make_app, **extra):
    config = config_with(
        [
            forward("big", "http://127.0.0.1:9/big", filter=BIG),
            forward("everything", "http://127.0.0.1:9/all"),
        ],
        **extra,
    )
    return make_app(config)


def _consumers_by_key(app) -> dict[str, list[str]]:
    """The consumers each event got a delivery for, by the event's dedup key."""
    from webhook_receiver.extensions import db
    from webhook_receiver.models import Event

    with app.app_context():
        keys = dict(db.session.execute(db.select(Event.id, Event.dedup_key)).all())
        db.session.rollback()
    found: dict[str, list[str]] = {key: [] for key in keys.values()}
    for row in delivery_rows(app):
        found[keys[row["event_id"]]].append(row["consumer"])
    return {key: sorted(names) for key, names in found.items()}


def _expected(keys: list[tuple[str, int]]) -> dict[str, list[str]]:
    return {key: ["big", "everything"] if n % 2 == 0 else ["everything"] for key, n in keys}


@pytest.mark.parametrize("fast", [True, False])
def test_a_filter_that_drops_half_the_events_gives_them_no_delivery(make_app, fast):
    app = _app(make_app)
    clock = Clock()
    with app.app_context():
        for n in range(10):
            assert isinstance(inbox.receive(_message(n, clock), fast=fast), inbox.Accepted)
    found = _consumers_by_key(app)
    assert found == _expected([(f"evt-{n}", n) for n in range(10)])
    assert sum(names.count("big") for names in found.values()) == 5


@pytest.mark.parametrize("fast", [True, False])
def test_a_broker_batch_is_filtered_message_by_message(make_app, fast):
    app = _app(make_app)
    clock = Clock()
    with app.app_context():
        outcomes = inbox.receive_many([_message(n, clock) for n in range(200)], fast=fast)
    assert all(isinstance(o, inbox.Accepted) for o in outcomes)
    assert _consumers_by_key(app) == _expected([(f"evt-{n}", n) for n in range(200)])


def test_a_signed_webhook_is_filtered(make_app):
    app = _app(make_app)
    client = app.test_client()
    for n in range(4):
        body = json.dumps(_order(n)).encode()
        headers = {
            "Content-Type": "application/json",
            "X-Signature": f"sha256={hmac_hex(body, SECRET)}",
            "Idempotency-Key": f"evt-{n}",
        }
        assert client.post(f"/webhooks/{SOURCE}", data=body, headers=headers).status_code == 200
    assert _consumers_by_key(app) == _expected([(f"evt-{n}", n) for n in range(4)])


def test_an_api_event_is_filtered(make_app):
    app = make_app(
        config_with(client_forwards=[forward("big", "http://127.0.0.1:9/big", filter=BIG)])
    )
    client = app.test_client()
    for n in range(4):
        response = post_event(client, key=f"k-{n}", body=_order(n), token=ACME_TOKEN)
        assert response.status_code == 201, response.get_data(as_text=True)
    found = _consumers_by_key(app)
    assert sorted(found.values()) == [[], [], ["big"], ["big"]]


def test_a_handler_filter_drops_events_as_a_forward_filter_does(make_app):
    config = config_with([forward("everything", "http://127.0.0.1:9/all")])
    config["handlers"] = ["tests.processing.filtered_handlers"]
    app = make_app(config)
    clock = Clock()
    with app.app_context():
        inbox.receive_many([_message(n, clock) for n in range(6)])
    found = _consumers_by_key(app)
    assert found == {
        f"evt-{n}": ["big-orders", "everything"] if n % 2 == 0 else ["everything"] for n in range(6)
    }


def test_a_body_that_is_not_json_passes_no_filter(make_app):
    app = _app(make_app)
    clock = Clock()
    with app.app_context():
        inbox.receive(_message(0, clock, body=b"amount=150"))
        inbox.receive(_message(1, clock, body=b'{"data": {"amount": 150}'))  # cut short
    assert _consumers_by_key(app) == {"evt-0": ["everything"], "evt-1": ["everything"]}


def test_a_body_holding_a_lone_surrogate_is_filtered_as_json(make_app):
    # Stored as sent by every intake (a webhook, a broker message, a
    # CloudEvent): an escaped lone surrogate in a member the filter does not
    # read must not make the whole body "not JSON" for the filter.
    app = _app(make_app)
    clock = Clock()
    big = b'{"type": "order.paid", "note": "\\ud800", "data": {"amount": 150}}'
    small = b'{"type": "order.paid", "note": "\\udfff", "data": {"amount": 50}}'
    with app.app_context():
        inbox.receive(_message(0, clock, body=big))
        inbox.receive(_message(1, clock, body=small))
    assert _consumers_by_key(app) == {"evt-0": ["big", "everything"], "evt-1": ["everything"]}


def test_an_expression_failing_on_a_body_drops_the_event(make_app):
    # length() of a number is a type error for this event: not delivered, not a failed receipt.
    config = config_with([forward("long", "http://127.0.0.1:9/long", filter="length(data) > `1`")])
    app = make_app(config)
    clock = Clock()
    with app.app_context():
        inbox.receive(_message(0, clock, body=b'{"data": 7}'))
        inbox.receive(_message(1, clock, body=b'{"data": [1, 2]}'))
    assert _consumers_by_key(app) == {"evt-0": [], "evt-1": ["long"]}


def test_the_event_page_names_the_consumers_a_filter_kept_it_from(make_app):
    app = make_app(
        config_with([forward("big", "http://127.0.0.1:9/big", filter=BIG)]),
        ADMIN_PASSWORD="correct horse battery staple",
    )
    clock = Clock()
    with app.app_context():
        small = inbox.receive(_message(1, clock)).event_id  # type: ignore[union-attr]
        big = inbox.receive(_message(2, clock)).event_id  # type: ignore[union-attr]
    from ..admin.conftest import login

    client = app.test_client()
    assert login(client).status_code == 302
    page = client.get(f"/admin/events/{small}").get_data(as_text=True)
    assert "Not forwarded to big: filter." in page
    page = client.get(f"/admin/events/{big}").get_data(as_text=True)
    assert "Not forwarded to" not in page


# -- the config ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("data.amount >=", "incomplete expression at character 14"),
        ("data amount", "Unexpected token: amount at character 5"),
        ("data.'amount", "Unclosed ' delimiter at character 5"),
        ("lenght(data)", "unknown function lenght()"),
        ("length(data, type)", "length() takes 1 argument(s), not 2"),
        ("", "must be a JMESPath expression"),
    ],
)
def test_a_bad_expression_is_one_line_at_config_load(expression, says):
    with pytest.raises(ConfigError) as info:
        parse_filter(expression, "forward big:")
    assert says in str(info.value)
    assert "\n" not in str(info.value)


def test_a_filter_of_another_type_is_refused():
    with pytest.raises(ConfigError, match="filter must be a JMESPath expression"):
        parse_filter(["data"], "forward big:")


def test_jmespath_truth_decides():
    # false, null and empty strings, lists and objects drop; every number keeps.
    for expression, body, kept in [
        ("data.n", b'{"data": {"n": 0}}', True),
        ("data.tags", b'{"data": {"tags": []}}', False),
        ("data.tags", b'{"data": {"tags": ["a"]}}', True),
        ("data.name", b'{"data": {"name": ""}}', False),
        ("data.missing", b'{"data": {}}', False),
        ("data.ok", b'{"data": {"ok": false}}', False),
        ("@", b"null", False),
    ]:
        assert parse_filter(expression, "x:").passes(document(body)) is kept, expression
    assert parse_filter("@", "x:").passes(NOT_JSON) is False


def test_create_app_refuses_a_bad_filter(make_app):
    with pytest.raises(ConfigError) as info:
        make_app(config_with([forward("big", "http://127.0.0.1:9/big", filter="data.[")]))
    assert str(info.value).endswith(
        "[[sources.shop.forward]] big: filter 'data.[': incomplete expression at character 6"
    )


def test_a_handler_with_a_bad_filter_stops_the_app(tmp_path, monkeypatch):
    (tmp_path / "bad_filter_handlers.py").write_text(
        textwrap.dedent(
            """
            from webhook_receiver.processing import handler

            @handler(source="shop", name="broken", filter="data.amount >")
            def broken(event, session):
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = config_with()
    config["handlers"] = ["bad_filter_handlers"]
    with pytest.raises(ConfigError) as info:
        create_app(
            {
                "TESTING": True,
                "SECRET_KEY": SECRET_KEY,
                "SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 'x.sqlite3'}",
                "RECEIVER_CONFIG": config,
            }
        )
    message = str(info.value)
    assert "handler 'broken': filter 'data.amount >'" in message
    assert "\n" not in message


def test_a_bad_filter_stops_the_worker_at_start_with_one_line(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(
        textwrap.dedent(
            """
            [sources.shop]
            provider = "generic"
            secrets = ["shop-secret-0123456789"]
            signature_header = "X-Signature"

            [[sources.shop.forward]]
            name = "big"
            url = "http://127.0.0.1:9/big"
            filter = "data.amount >= `100"
            """
        )
    )
    result = subprocess.run(
        [str(BIN / "flask"), "--app", "wsgi", "worker", "--drain"],
        cwd=ROOT,
        env=app_env(f"sqlite:///{tmp_path / 'app.sqlite3'}", path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("Error: ")
    assert "big: filter 'data.amount >= `100'" in result.stderr
    assert "Unclosed ` delimiter" in result.stderr


def test_routes_parse_the_body_only_for_consumers_with_a_filter(make_app, monkeypatch):
    app = make_app(config_with([forward("everything", "http://127.0.0.1:9/all")]))
    parsed = []
    monkeypatch.setattr(registry, "document", lambda body: parsed.append(body))
    route = registry.get(app).route
    assert route(SOURCE, "order.paid", b"not even json") == [("everything", "forward")]
    assert parsed == []
