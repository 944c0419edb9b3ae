"""The admin's Targets page: each consumer's circuit, rate limit, concurrency and filter."""

from __future__ import annotations

from datetime import timedelta

from webhook_receiver.database import unit_of_work
from webhook_receiver.outbox import circuits

from ..processing.conftest import config_with, forward
from .conftest import NOW, PASSWORD, login, text


def _app(make_app):
    config = config_with(
        [
            forward("billing", "http://127.0.0.1:9/b", max_per_second=12.5, concurrency=3),
            forward("archive", "http://127.0.0.1:9/a", circuit_breaker=False),
            forward(
                "big",
                "http://127.0.0.1:9/big",
                filter="data.amount > `100` && data.note != '<b>'",
                circuit_breaker={"failures": 2, "cool_down_seconds": 30},
            ),
        ],
        handlers=True,
    )
    return make_app(config, ADMIN_PASSWORD=PASSWORD)


def _row(page: str, target: str) -> str:
    return page.split(f'data-target="{target}"', 1)[1].split("</tr>", 1)[0]


def test_the_targets_page_needs_a_login(make_app):
    app = _app(make_app)
    response = app.test_client().get("/admin/targets")
    assert response.status_code == 302
    assert "/admin/login" in response.headers["Location"]


def test_each_consumer_is_shown_with_its_circuit_and_settings(make_app):
    app = _app(make_app)
    client = app.test_client()
    assert login(client).status_code == 302
    with app.app_context(), unit_of_work():
        circuits.fail("shop", "big", NOW, 2, NOW + timedelta(seconds=30))
        circuits.fail("shop", "big", NOW, 2, NOW + timedelta(seconds=30))
        circuits.fail("shop", "billing", NOW, 5, NOW + timedelta(seconds=60))
    page = text(client.get("/admin/targets"))
    assert 'href="/admin/targets" aria-current="page">Targets<' in page

    billing = _row(page, "shop/billing")
    assert 'class="state state-closed">closed<' in billing
    assert '<td class="num">1</td>' in billing  # one failure in a row so far
    assert "12.5/s" in billing
    assert "3 per worker" in billing
    assert "5 failures, 60 s" in billing

    big = _row(page, "shop/big")
    assert 'class="state state-open">open<' in big
    assert NOW.strftime("%Y-%m-%d %H:%M") in big  # opened
    assert (NOW + timedelta(seconds=30)).strftime("%H:%M:%S") in big  # next probe
    assert "2 failures, 30 s" in big
    # The filter is shown as written, escaped.
    assert "data.amount &gt; `100` &amp;&amp; data.note != &#39;&lt;b&gt;&#39;" in big
    assert "<b>" not in big

    archive = _row(page, "shop/archive")
    assert "state-" not in archive
    assert ">off<" in archive
    ledger = _row(page, "shop/ledger")
    assert "handler" in ledger
    assert "state-" not in ledger


def test_a_half_open_circuit_says_its_probe_is_in_flight(make_app):
    app = _app(make_app)
    client = app.test_client()
    assert login(client).status_code == 302
    later = NOW + timedelta(seconds=30)
    with app.app_context():
        with unit_of_work():
            circuits.fail("shop", "big", NOW, 1, later)
        with unit_of_work():
            assert circuits.take_probe("shop", "big", "token", later, later + timedelta(5))
    big = _row(text(client.get("/admin/targets")), "shop/big")
    assert 'class="state state-half_open">half open<' in big
    assert "in flight until " + (later + timedelta(5)).strftime("%Y-%m-%d %H:%M:%S") in big


def test_a_cool_down_that_is_over_or_a_lapsed_probe_says_the_next_delivery_probes(make_app):
    # Both showed a time in the past (or "in flight") as if a probe were
    # still to come or running; nothing happens until a delivery comes.
    app = _app(make_app)
    client = app.test_client()
    assert login(client).status_code == 302
    long_ago = NOW - timedelta(minutes=10)
    with app.app_context():
        with unit_of_work():
            circuits.fail("shop", "big", long_ago, 1, long_ago + timedelta(seconds=30))
            circuits.fail("shop", "billing", long_ago, 1, long_ago + timedelta(seconds=30))
        with unit_of_work():
            probe_at = long_ago + timedelta(seconds=30)
            assert circuits.take_probe(
                "shop", "billing", "t", probe_at, probe_at + timedelta(seconds=5)
            )
    page = text(client.get("/admin/targets"))
    big = _row(page, "shop/big")
    assert 'class="state state-open">open<' in big
    cool_down_end = (long_ago + timedelta(seconds=30)).strftime("%Y-%m-%d %H:%M:%S")
    assert f"{cool_down_end} (due: the next delivery probes)" in big
    billing = _row(page, "shop/billing")
    assert 'class="state state-half_open">half open<' in billing
    lapsed = (long_ago + timedelta(seconds=35)).strftime("%Y-%m-%d %H:%M:%S")
    assert f"lapsed at {lapsed}: the next delivery probes" in billing
    assert "in flight" not in billing
