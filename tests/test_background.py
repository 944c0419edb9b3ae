"""The background writer: what a process gathered is written when the process exits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, func, select

from webhook_receiver.models import Event, Rejection

EXITING_PROCESS = """
import sys
from webhook_receiver import create_app
from tests.conftest import SECRET_KEY
from tests.helpers import signing as s

app = create_app({
    "TESTING": True,
    "SECRET_KEY": SECRET_KEY,
    "SQLALCHEMY_DATABASE_URI": sys.argv[1],
    "DUPLICATE_FLUSH_SECONDS": 3600,
    "REJECTION_FLUSH_SECONDS": 3600,
    "RECEIVER_CONFIG": {"sources": s.SOURCES},
})
client = app.test_client()
body, headers = s.stripe_delivery({"id": "evt_exit", "type": "invoice.paid"})
for _ in range(3):
    assert client.post("/webhooks/stripe-live", data=body, headers=headers).status_code == 200
forged = {"Stripe-Signature": "t=1,v1=" + "0" * 64, "Content-Type": "application/json"}
for _ in range(4):
    assert client.post("/webhooks/stripe-live", data=b"{}", headers=forged).status_code == 401
# An hour's interval: nothing written yet, and the process now simply ends.
"""


def test_a_process_exiting_writes_its_pending_redeliveries_and_refusals(db_url) -> None:
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", EXITING_PROCESS, db_url],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            counts = conn.execute(select(Event.duplicate_count)).scalars().all()
            refused = conn.scalar(select(func.sum(Rejection.seen_count)))
    finally:
        engine.dispose()
    assert counts == [2]  # the two redeliveries, written by the exit hook
    assert refused == 4
