"""Forward headers from what an event carries: a value no HTTP header can hold is sent encoded.

A broker message's correlation id and content type are any text (the HTTP
intakes keep only what a header carries), and they are sent downstream as
``X-Request-Id`` and ``Content-Type``.
"""

from __future__ import annotations

from urllib.parse import quote

import pytest

from .conftest import FAST, config_with, delivery, drain, forward, store_event


@pytest.mark.parametrize(
    "correlation_id",
    ["order-\u20ac-1", "line\nbreak", "carriage\rreturn", " leading-space"],
    ids=["outside-latin-1", "newline", "carriage-return", "leading-space"],
)
def test_a_correlation_id_no_header_can_carry_is_forwarded_percent_encoded(
    make_app, downstream, clock, make_worker, correlation_id
):
    # A character past Latin-1 raised UnicodeEncodeError out of the worker's
    # thread (the delivery leased until its lease ended, again on every
    # attempt, then dead); a newline or a leading space was an
    # InvalidHeader, retried to the attempt limit. Neither could ever be sent.
    app = make_app(config_with([forward("billing", downstream.url + "/billing")]), **FAST)
    event_id = store_event(app, clock, dedup_key="evt-1", correlation_id=correlation_id)
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    [call] = downstream.calls_to("/billing")
    assert call.headers["X-Request-Id"] == quote(correlation_id, safe="")
    assert delivery(app, event_id, "billing")["state"] == "delivered"


@pytest.mark.parametrize("correlation_id", ["two words", "caf\u00e9", "tab\there", "req-1:a/b+c=d"])
def test_a_correlation_id_a_header_can_carry_is_forwarded_as_it_is(
    make_app, downstream, clock, make_worker, correlation_id
):
    app = make_app(config_with([forward("billing", downstream.url + "/billing")]), **FAST)
    store_event(app, clock, dedup_key="evt-1", correlation_id=correlation_id)
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    [call] = downstream.calls_to("/billing")
    assert call.headers["X-Request-Id"] == correlation_id


def test_a_content_type_no_header_can_carry_is_forwarded_percent_encoded(
    make_app, downstream, clock, make_worker
):
    app = make_app(config_with([forward("billing", downstream.url + "/billing")]), **FAST)
    store_event(app, clock, dedup_key="evt-1", content_type="text/plain; charset=\u20ac")
    assert drain(app, make_worker(app, clock)) == ["delivered"]
    [call] = downstream.calls_to("/billing")
    assert call.headers["Content-Type"] == quote("text/plain; charset=\u20ac", safe="")
