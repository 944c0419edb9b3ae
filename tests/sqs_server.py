"""An SQS for the tests: moto's server, once per session, on a free 127.0.0.1 port.

moto (``moto[server]``) implements the SQS API the consumer uses: standard
and FIFO queues, FIFO deduplication, visibility timeouts, redrive policies.
Its receive reads the queue's every attribute once per message it returns
(``is_message_valid_based_on_retention_period``), and its send once per
message sent, each attribute a scan of the whole queue that tells the time
(two datetimes) once per message: a receive from a queue of 2,000 messages
took half a second, and sending 1,300 messages half a minute. The server
is started through this module, which reads the retention period alone
for that check and the clock with ``time.time()``: the same answers, a
scan's worth of cost.

:func:`endpoint` starts it the first time it is called in a process and
returns its URL; it is stopped when the process exits. ``TEST_SQS_ENDPOINT``
points the tests at another SQS-compatible server instead. moto takes any
credentials: :data:`CREDENTIALS` are the environment the tests' processes
get (the standard AWS chain reads them first).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from .session_server import SessionServer

ROOT = Path(__file__).resolve().parent.parent
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
REGION = "eu-west-1"

_SERVER = SessionServer(
    "moto", lambda port: [sys.executable, "-m", "tests.sqs_server", str(port)], cwd=ROOT
)
log_text = _SERVER.log_text


def endpoint() -> str:
    """The test SQS's URL, started first if this process has none yet."""
    given = os.environ.get("TEST_SQS_ENDPOINT")
    if given:
        return given
    return f"http://127.0.0.1:{_SERVER.port()}"


def client(url: str) -> Any:
    """A boto3 SQS client of the test server."""
    import boto3

    return boto3.client(
        "sqs",
        region_name=REGION,
        endpoint_url=url,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )


def _serve(port: int) -> None:
    """Run moto's server on ``port``, its SQS reading the clock and the retention cheaply."""
    import moto.sqs.models as sqs_models
    from moto.server import main

    exact_millis = sqs_models.unix_time_millis

    def unix_time_millis(dt: Any = None) -> float:
        # Without a date, moto builds two datetimes to tell the time: a
        # queue's every attribute reads it once per message held.
        return time.time() * 1000.0 if dt is None else float(exact_millis(dt))

    def within_retention(self: Any, queue_name: str, message: Any) -> bool:
        queue = self.get_queue(queue_name)
        retain_until = int(queue.message_retention_period) + message.sent_timestamp / 1000
        return bool(retain_until > time.time())

    sqs_models.unix_time_millis = unix_time_millis
    sqs_models.unix_time = lambda dt=None: time.time() if dt is None else exact_millis(dt) / 1000
    sqs_models.SQSBackend.is_message_valid_based_on_retention_period = within_retention  # type: ignore[method-assign]
    main(["-H", "127.0.0.1", "-p", str(port)])


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
