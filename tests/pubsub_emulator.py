"""A Google Cloud Pub/Sub for the tests: the emulator, once per session, on a free port.

The Debian package ``google-cloud-cli-pubsub-emulator`` ships the emulator
(a Java server) with the Cloud SDK; its start script is run directly, as
``gcloud beta emulators pubsub start`` would. It keeps everything in
memory, so each test creates its own topics and subscriptions.

:func:`host` starts it the first time it is called in a process and returns
``"127.0.0.1:PORT"``, the value of ``PUBSUB_EMULATOR_HOST`` through which
google-cloud-pubsub (the consumer's and the tests') reaches it; it is
stopped when the process exits. ``TEST_PUBSUB_EMULATOR_HOST`` points the
tests at an emulator already running instead.
"""

from __future__ import annotations

import os
import shutil

from .session_server import SessionServer

# Where the Debian package puts the start script (the Cloud SDK's platform folder).
SCRIPT = "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator"


def script() -> str:
    """The emulator's start script, or RuntimeError naming the package that ships it."""
    found = shutil.which("cloud-pubsub-emulator") or SCRIPT
    if not os.access(found, os.X_OK):
        raise RuntimeError(
            f"no Pub/Sub emulator at {found}: install google-cloud-cli-pubsub-emulator"
        )
    return found


# It listens a moment before it serves: its own line says when it does.
_SERVER = SessionServer(
    "the Pub/Sub emulator",
    lambda port: [script(), "--host=127.0.0.1", f"--port={port}"],
    startup_seconds=60.0,
    ready_line="Server started",
)
log_text = _SERVER.log_text


def host() -> str:
    """The emulator's ``host:port``, started first if this process has none yet."""
    given = os.environ.get("TEST_PUBSUB_EMULATOR_HOST")
    if given:
        return given
    return f"127.0.0.1:{_SERVER.port()}"
