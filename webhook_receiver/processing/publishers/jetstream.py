"""Forwards to NATS JetStream (``nats://``, ``tls://``): done on the stream's PubAck.

A PubAck marked ``duplicate`` counts too: JetStream's duplicate window
dropped a republish of a message it has (the ``Nats-Msg-Id`` is the
forward's stable key). A message larger than the server's ``max_payload``
(1 MB by default) or the stream's ``max_msg_size`` goes dead at once: no
attempt gets past either. One event loop per process serves every thread's
publishes, on one connection per URL. ``timeout_seconds`` bounds the whole
attempt: a first connect and the wait for the PubAck share it.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
from collections.abc import Coroutine
from typing import Any

import nats
import nats.errors
import nats.js.errors

from ...config import ForwardConfig, redact_url
from .base import BrokerMessage, PublishError, PublishRefused

log = logging.getLogger(__name__)

SCHEMES = frozenset({"nats", "tls"})
# JetStream's error code for a message past the stream's max_msg_size.
_MESSAGE_TOO_LARGE = 10054


class _NatsLoop:
    """One event loop thread per process for JetStream publishes, with a connection per URL."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.connections: dict[str, Any] = {}
        # A first connect in progress, per URL: publishes that race for it share it.
        self.connecting: dict[str, asyncio.Future[Any]] = {}
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="nats-publisher", daemon=True
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def jetstream(self, url: str, timeout: float) -> Any:
        nc: Any = self.connections.get(url)
        if nc is None or nc.is_closed:
            pending = self.connecting.get(url)
            if pending is None:
                pending = self.connecting[url] = asyncio.ensure_future(self._connect(url, timeout))
                pending.add_done_callback(lambda _done: self.connecting.pop(url, None))
            # A caller that gives up does not cancel the connect others wait on.
            nc = await asyncio.shield(pending)
        return nc.jetstream()

    async def _connect(self, url: str, timeout: float) -> Any:
        # Once connected, nats-py reconnects by itself for as long as it
        # takes; its first connect would retry just as long, unseen, and
        # every publish retried meanwhile used to start one more. This one
        # is bounded, and closed if it did not finish.
        async def on_error(exc: Exception) -> None:
            # Each failed attempt; the delivery's own error says what failed.
            log.debug("nats forward to %s: %s", redact_url(url), exc)

        nc = nats.NATS()
        try:
            await asyncio.wait_for(
                nc.connect(
                    url,
                    name="webhook-receiver forwards",
                    error_cb=on_error,
                    connect_timeout=max(1, round(timeout)),
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=1,
                ),
                timeout,
            )
        except BaseException:
            try:
                await nc.close()
            except Exception:
                pass
            raise
        self.connections[url] = nc
        return nc

    async def close(self) -> None:
        for nc in self.connections.values():
            try:
                await nc.close()
            except Exception:
                pass


_nats_loop: _NatsLoop | None = None
_nats_lock = threading.Lock()


def _loop() -> _NatsLoop:
    global _nats_loop
    with _nats_lock:
        if _nats_loop is None:
            _nats_loop = _NatsLoop()
        return _nats_loop


@atexit.register
def _close_nats() -> None:
    if _nats_loop is not None:
        try:
            _nats_loop.run(_nats_loop.close(), timeout=2)
        except Exception:
            pass


def publish(forward: ForwardConfig, message: BrokerMessage) -> None:
    headers = message.headers_named("Nats-Msg-Id", "Content-Type", "X-Webhook-Event-Type")
    loop = _loop()

    async def go() -> Any:
        js = await loop.jetstream(forward.url, forward.timeout_seconds)
        return await js.publish(
            forward.subject or "", message.body, timeout=forward.timeout_seconds, headers=headers
        )

    timeout = forward.timeout_seconds
    try:
        # A PubAck, duplicate or not, means the stream holds the message. One
        # deadline for the connect and the PubAck together: each had the
        # whole timeout, twice what the worker's lease is sized for. The
        # wait here only backs the loop's own up.
        loop.run(asyncio.wait_for(go(), timeout), timeout=timeout + 5)
    except nats.js.errors.NoStreamResponseError as exc:
        raise PublishError(f"no JetStream stream takes subject {forward.subject!r}") from exc
    except nats.errors.MaxPayloadError as exc:
        raise PublishRefused(
            f"the message ({len(message.body)} bytes of body) is larger than the "
            f"max_payload of {redact_url(forward.url)}"
        ) from exc
    except nats.js.errors.APIError as exc:
        if exc.err_code != _MESSAGE_TOO_LARGE:
            raise PublishError(f"{type(exc).__name__} on {redact_url(forward.url)}: {exc}") from exc
        raise PublishRefused(
            f"the message ({len(message.body)} bytes of body) is larger than the stream "
            f"taking {forward.subject!r} takes: {exc}"
        ) from exc
    except TimeoutError as exc:  # nats-py's own timeouts are TimeoutErrors too
        raise PublishError(
            f"no PubAck from {redact_url(forward.url)} within {timeout:g} s "
            f"(its connect included): {type(exc).__name__}"
        ) from exc
    except (nats.errors.Error, OSError) as exc:
        raise PublishError(f"{type(exc).__name__} on {redact_url(forward.url)}: {exc}") from exc
