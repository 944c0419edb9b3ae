"""``inbox.add``: an event written inside the caller's unit of work (the API's).

On PostgreSQL it runs the one-statement receipt on the driver, inside the
session's transaction; the plain Core path is the reference. Both
databases, as every inbox test.
"""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from webhook_receiver import inbox
from webhook_receiver.database import unit_of_work
from webhook_receiver.extensions import db
from webhook_receiver.models import Delivery, Event

from .test_inbox import _config, _count, _delivery_rows, _event_row, message


@pytest.mark.parametrize("forwards", [False, True], ids=["alone", "with-deliveries"])
@pytest.mark.parametrize(
    "fields",
    [{}, {"event_type": None, "content_type": None, "correlation_id": None, "meta": {}}],
    ids=["every-column", "nulls"],
)
def test_add_stores_what_the_core_path_stores(make_app, forwards, fields):
    app = make_app(_config(forwards=forwards))
    with app.app_context():
        with unit_of_work():
            fast_id = inbox.add(message("fast", **fields))
            core_id = inbox.add(message("core", **fields), fast=False)
        assert fast_id is not None and core_id is not None
        db.session.expire_all()
        fast_row, core_row = _event_row(fast_id), _event_row(core_id)
        for row in (fast_row, core_row):
            del row["id"], row["dedup_key"]
        assert fast_row == core_row
        fast_deliveries, core_deliveries = _delivery_rows(fast_id), _delivery_rows(core_id)
        assert len(fast_deliveries) == (2 if forwards else 0)
        for rows in (fast_deliveries, core_deliveries):
            for row in rows:
                del row["id"], row["event_id"]
        assert fast_deliveries == core_deliveries


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "core"])
def test_add_commits_or_rolls_back_with_the_unit_of_work(make_app, fast):
    app = make_app(_config(forwards=True))
    with app.app_context():
        with pytest.raises(RuntimeError), unit_of_work():
            assert inbox.add(message("k1"), fast=fast) is not None
            raise RuntimeError("the view failed after the write")
        assert _count(Event) == 0 and _count(Delivery) == 0
        with unit_of_work():
            event_id = inbox.add(message("k1"), fast=fast)
            # A taken key inside the same transaction is None, not an error.
            assert inbox.add(message("k1"), fast=fast) is None
        assert event_id is not None
        assert _count(Event) == 1 and _count(Delivery) == 2


def test_a_failed_add_is_sqlalchemys_error_and_leaves_nothing(make_app, db_url):
    # A statement the database refuses comes out as SQLAlchemy's error (the
    # app answers 503 or 500 on those), and the unit of work rolls back.
    app = make_app(_config(forwards=False))
    with app.app_context():
        with pytest.raises(DBAPIError), unit_of_work() as session:
            session.execute(text("SELECT 1"))
            inbox.add(message("k1", body=None))  # events.body is NOT NULL
        assert _count(Event) == 0
