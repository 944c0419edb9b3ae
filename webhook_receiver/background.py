"""A process's bookkeeping written in the background: gathered, then flushed in batches.

Redeliveries' counts (inbox/duplicates.py) and refused deliveries
(rejections.py) are bookkeeping, not idempotency: each process gathers them
and one thread writes them together, at most ``flush_seconds`` later, and
again when the process exits or the app closes. This class is that thread,
its life cycle and a flush's round (take the batch, write it, put it back
if the write failed); a subclass says what is pending and how to write it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Any, Generic, TypeVar

from sqlalchemy.engine import Engine

# What a subclass gathers and writes at once: a list, a dict of counts.
Batch = TypeVar("Batch")


class BackgroundWriter(Generic[Batch]):
    """A thread that calls ``flush()`` every ``flush_seconds`` while anything is due."""

    thread_name = "background-writer"
    # What the log line of a batch not written counts ("redeliveries"), and its outcome field.
    unwritten: str = "items"
    unwritten_outcome: str | None = None

    def __init__(self, engine: Engine, flush_seconds: float) -> None:
        # The database the subclass writes to.
        self.engine = engine
        self.flush_seconds = flush_seconds
        self._lock = threading.Lock()  # guards the subclass's pending state
        self._flushing = threading.Lock()  # one write at a time (thread and exit)
        self._due = threading.Event()
        self._closing = threading.Event()
        # Set to end the interval's gathering early: when closing.
        self._now = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        _WRITERS.add(self)

    def flush(self) -> int:
        """Write what is pending now; return how much was written (0 if the write failed)."""
        with self._flushing:
            batch = self._take()
            if not batch:
                return 0
            try:
                self._write(batch)
            except Exception:
                # Under the subclass's module's logger, as each logged it before.
                logging.getLogger(type(self).__module__).warning(
                    "could not record %d %s; will try again",
                    self._size(batch),
                    self.unwritten,
                    exc_info=True,
                    extra={"outcome": self.unwritten_outcome} if self.unwritten_outcome else None,
                )
                self._put_back(batch)
                return 0
            return self._size(batch)

    def pending(self) -> int:
        """How much waits to be written."""
        raise NotImplementedError

    def _take(self) -> Batch:
        """Take what is pending (under ``_lock``), leaving nothing pending."""
        raise NotImplementedError

    def _write(self, batch: Batch) -> None:
        """Write ``batch`` in one transaction of its own."""
        raise NotImplementedError

    def _put_back(self, batch: Batch) -> None:
        """Keep a batch whose write failed for the next round."""
        raise NotImplementedError

    def _size(self, batch: Batch) -> int:
        """How much ``batch`` counts (what ``flush`` returns)."""
        raise NotImplementedError

    def wake(self) -> None:
        """Something is pending: have it written within the flush interval."""
        self._start_thread()
        if not self._due.is_set():  # set() takes a lock even when it changes nothing
            self._due.set()

    def close(self) -> None:
        """Stop the thread and write what is pending."""
        self._closing.set()
        self._now.set()
        self._due.set()
        thread = self._thread
        if thread is not None and self._pid == os.getpid():
            thread.join(timeout=self.flush_seconds + 30)
        self.flush()

    def _start_thread(self) -> None:
        # A forked child (a gunicorn worker of a preloaded app) has no copy of
        # its parent's thread: it starts its own.
        if self._thread is not None and self._pid == os.getpid():
            return
        with self._lock:
            if self._thread is not None and self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._due.wait()
            # Let the interval gather a batch, unless hurried (close() writes
            # what is left); what arrives while the batch is written sets _due again.
            self._now.wait(self.flush_seconds)
            if self._closing.is_set():
                return
            self._now.clear()
            self._due.clear()
            self.flush()


_WRITERS: weakref.WeakSet[BackgroundWriter[Any]] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    # A gunicorn worker stopped gracefully (SIGTERM, max_requests, reload)
    # exits through here: what it gathered is written before it goes.
    for writer in list(_WRITERS):
        if writer._pid == os.getpid():
            for _ in range(3):  # no later round will come
                writer.flush()
                if not writer.pending():
                    break
