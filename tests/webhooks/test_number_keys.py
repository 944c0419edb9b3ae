"""A number read as a dedup key, or held in a body, is one value however it is written."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from webhook_receiver.extensions import db
from webhook_receiver.models import Event

from ..helpers import post_hmac
from ..helpers import signing as s


@pytest.fixture
def app(make_app):
    return make_app({"sources": s.SOURCES})


def test_an_id_re_serialised_as_a_float_is_a_duplicate(app, client):
    first = post_hmac(client, "generic-json", b'{"meta": {"delivery": 77}, "amount": 5}')
    assert first.status_code == 200
    for again in (
        b'{"meta": {"delivery": 77.0}, "amount": 5.0}',
        b'{"amount":5e0,"meta":{"delivery":7.7e1}}',
    ):
        answer = post_hmac(client, "generic-json", again)
        assert answer.status_code == 200, answer.get_json()
        assert answer.get_json()["event_id"] == first.get_json()["event_id"]
        assert answer.headers["Idempotent-Replayed"] == "true"
    with app.app_context():
        (event,) = db.session.scalars(select(Event)).all()
    assert (event.dedup_key, event.duplicate_count) == ("77", 2)


def test_a_float_key_is_written_as_ecmascript_writes_it(app, client):
    assert post_hmac(client, "generic-json", b'{"meta": {"delivery": 1e21}}').status_code == 200
    assert post_hmac(client, "generic-json", b'{"meta": {"delivery": 0.5}}').status_code == 200
    with app.app_context():
        keys = db.session.scalars(select(Event.dedup_key).order_by(Event.id)).all()
    assert keys == ["1e+21", "0.5"]
