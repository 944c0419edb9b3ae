"""Engine set-up and the unit-of-work helper.

SQLite is made fit for several gunicorn workers (WAL, a busy timeout,
foreign keys). Its driver's implicit transactions are replaced by explicit
ones, so that a transaction whose first statement writes waits on the busy
timeout instead of failing: code that must read and then write ends the read
first, or opens the write transaction with the write.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, TypeVar

import orjson
from flask import Flask, current_app, has_app_context
from sqlalchemy import event, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, ProgrammingError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, scoped_session

from .extensions import db

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 10_000
# TCP keepalives on every PostgreSQL connection: a server (or a path to it)
# that vanished without a FIN is noticed within about half a minute, instead
# of a read that waits forever for an answer. Probes start after 10 s idle,
# every 5 s, 3 unanswered ones drop the connection; data sent and not
# acknowledged for 30 s drops it too (tcp_user_timeout, in ms).
POSTGRESQL_KEEPALIVES: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
# What stall_watch waits before it warns, outside an app (or without the setting).
STALL_WARNING_SECONDS = 5.0


def engine_options(uri: str, *, transaction_pooler: bool = False) -> dict[str, Any]:
    """Return the engine options that suit the database behind ``uri``.

    ``transaction_pooler``: connections go through pgbouncer (or another
    pooler) in transaction mode, where server-side prepared statements
    would meet another client's session; psycopg must not prepare any.
    """
    if uri.startswith("sqlite"):
        return {
            "connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            "json_serializer": json_text,
        }
    if uri.startswith("postgresql"):
        # Refuse fast when the server is unreachable, so callers get a 503
        # rather than hanging until the load balancer gives up.
        connect_args: dict[str, Any] = {"connect_timeout": 5}
        if transaction_pooler:
            connect_args["prepare_threshold"] = None
        return {
            "connect_args": connect_args,
            "pool_size": 5,
            "max_overflow": 5,
            "json_serializer": json_text,
        }
    return {}


def json_text(value: Any) -> str:
    """The JSON text of a JSON column's value (the engine's ``json_serializer``).

    orjson, in a third of the standard library's time: every event's headers
    and meta, and a PostgreSQL batch's rows as one document. What orjson
    refuses (an integer beyond 64 bits, a key that is not a string) goes
    through json, as before. Fingerprints keep json's canonical form
    (fingerprint.py): this text is only ever parsed back.
    """
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value)


def _on_sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    if not isinstance(dbapi_connection, sqlite3.Connection):
        return
    # Hand transaction control to SQLAlchemy (the driver's own BEGIN comes
    # late and breaks SAVEPOINT); see _on_sqlite_begin.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    # The busy timeout first, so that nothing below fails at once on a lock.
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    # WAL is a property of the file: asked for only when the file lacks it,
    # since switching needs a lock that another process's first connection
    # may hold (a worker's first request failed "database is locked").
    if cursor.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
        cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    # An acknowledged delivery must survive power loss, not only a crash:
    # NORMAL would be faster in WAL mode but may lose the last commits.
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


# The driver runs every SQLite connection in autocommit mode (see
# _on_sqlite_connect), so a connection that skips the BEGIN runs each
# statement on its own. Cheaper than SQLAlchemy's AUTOCOMMIT level, which
# would switch the driver back to its implicit transactions on the way
# back to the pool, with a PRAGMA each way.
_NO_BEGIN = "webhook_receiver_no_begin"


def _on_sqlite_begin(connection: Connection) -> None:
    if connection.get_execution_options().get(_NO_BEGIN):
        return
    # Straight on the driver: through exec_driver_sql, SQLAlchemy's
    # execution machinery tripled what a unit of work's session costs
    # (about 90 µs of CPU per transaction).
    with driver_errors(connection.engine, lambda: connection):
        connection.connection.driver_connection.execute("BEGIN")  # type: ignore[union-attr]


@contextmanager
def driver_errors(engine: Engine, owner: Callable[[], Any]) -> Iterator[None]:
    """Raise the driver's errors as SQLAlchemy's; on a disconnect, drop ``owner()``'s connection.

    Around statements sent on the driver itself, past SQLAlchemy's execution
    (SQLite's BEGIN, database_driver's cursors), so that they fail as any
    other statement would. ``owner()`` is a pooled connection or a Connection (None before one is
    had): what SQLAlchemy would invalidate.
    """
    dialect = engine.dialect
    dbapi_error = dialect.loaded_dbapi.Error
    try:
        yield
    except dbapi_error as exc:
        held = owner()
        driver = None
        if held is not None:
            pooled = held.connection if isinstance(held, Connection) else held
            driver = pooled.dbapi_connection
        invalidated = driver is not None and dialect.is_disconnect(exc, driver, None)
        if invalidated:
            # As SQLAlchemy does on a disconnect: the other pooled
            # connections went with the server, so the pool is replaced.
            held.invalidate(exc)
            engine.dispose(close=False)
        raise DBAPIError.instance(
            "",
            None,
            exc,
            dbapi_error,
            hide_parameters=True,
            connection_invalidated=invalidated,
            dialect=dialect,
        ) from exc


# PostgreSQL's read_only_sql_transaction: a standby after a failover, or a
# pooler still pointed at a demoted primary. psycopg files it under
# InternalError, but for a writer it is the database being away.
_READ_ONLY = "25006"
# query_canceled: the statement timeout fired (a lock held for too long, a
# server too slow to answer), or an operator cancelled the statement.
_QUERY_CANCELED = "57014"
# data_corrupted and index_corrupted: a damaged page or index, which every
# statement touching it meets until an operator repairs it; messages must
# wait for that on their broker, never be dead-lettered one by one.
_CORRUPTED = frozenset({"XX001", "XX002"})
_AWAY_SQLSTATES = frozenset({_READ_ONLY, _QUERY_CANCELED, *_CORRUPTED})
# program_limit_exceeded (class 54): a statement past one of the server's
# limits (an index row over btree's 2704 bytes, a jsonb document past
# 256 MB). psycopg files it under OperationalError, but the statement is at
# fault, not the database: sent again, it fails again.
_PROGRAM_LIMIT_CLASS = "54"
# SQLite's primary result codes (an error's ``sqlite_errorcode`` & 0xFF) of
# a database that cannot be used now: busy or locked past the busy timeout,
# out of memory, read-only, interrupted, an I/O error, a full disk, a file
# that cannot be opened, a lock protocol error, a statement prepared before
# the schema changed, a permission refused, a statement aborted by a
# rollback, a damaged file (corrupt, or not a database at all: every
# statement fails until it is restored, and a broker's messages must wait
# for that rather than be dead-lettered one by one). The driver files them
# under OperationalError, but so it does SQLITE_ERROR, what a faulty
# statement gets (too many SQL variables, too many terms in a compound
# SELECT, a syntax error, a missing table), and SQLITE_RANGE and
# SQLITE_MISUSE are InterfaceErrors: sent again, those fail again. Any code
# not here (SQLITE_TOOBIG, a DataError: a string or blob past
# SQLITE_MAX_LENGTH; a constraint) is the statement's fault too.
_SQLITE_AWAY_CODES = frozenset(
    {
        sqlite3.SQLITE_PERM,
        sqlite3.SQLITE_ABORT,
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_READONLY,
        sqlite3.SQLITE_INTERRUPT,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_PROTOCOL,
        sqlite3.SQLITE_SCHEMA,
        sqlite3.SQLITE_CORRUPT,
        sqlite3.SQLITE_NOTADB,
    }
)
_SQLITE_DAMAGED = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
# deadlock_detected and serialization_failure: the transaction lost a race
# with another one and was rolled back; run again, it is expected to pass.
_CONFLICT_SQLSTATES = frozenset({"40P01", "40001"})
# How many times a unit of work that loses such a race is run in all.
CONFLICT_ATTEMPTS = 3

Result = TypeVar("Result")


# SQLite says "no such table"; PostgreSQL raises UndefinedTable ('relation "x" does
# not exist'), not to be confused with a database that does not exist.
_NO_SCHEMA = ("no such table", "undefinedtable", 'relation "')


def is_missing_schema(exc: BaseException) -> bool:
    """Tell whether a database error says a table is missing: the migrations never ran."""
    if not isinstance(exc, OperationalError | ProgrammingError):
        return False
    cause = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
    return any(marker in f"{type(exc.orig).__name__} {cause}".lower() for marker in _NO_SCHEMA)


def is_unavailable(exc: BaseException) -> bool:
    """Tell the database being away, locked or read-only (retry later) from a faulty statement.

    The one test the HTTP edge (503) and the broker consumers (requeue, back
    off) share. OperationalError covers refused and dropped connections, a
    server shutting down and SQLite's "database is locked" (or read-only
    file) past the busy timeout; a pool with no connection to lend within
    its timeout is a busy database too. So is a statement cancelled by the
    statement timeout (SQLSTATE 57014), whatever class the driver gives it.
    A statement past one of PostgreSQL's limits (SQLSTATE class 54, an
    OperationalError to psycopg) is not: it is the statement's fault. On
    SQLite an error is told by its result code (``_SQLITE_AWAY_CODES``), not
    its class: SQLITE_ERROR (too many SQL variables, say) is an
    OperationalError, and the statement's fault; an error the driver made
    without a code (the writers' turn past the busy timeout) by its class. A
    deadlock or serialization failure (is_conflict, an OperationalError to
    psycopg) is a busy database here: ``retrying_conflicts`` runs the unit
    of work again at once first, so only one that outlasts its attempts
    comes this far.
    """
    if isinstance(exc, PoolTimeout):
        return True
    if not isinstance(exc, DBAPIError):
        return False
    code = getattr(exc.orig, "sqlite_errorcode", None)
    if code is not None:
        return bool(exc.connection_invalidated) or code & 0xFF in _SQLITE_AWAY_CODES
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if isinstance(exc, OperationalError | InterfaceError):
        return not (
            sqlstate
            and sqlstate.startswith(_PROGRAM_LIMIT_CLASS)
            and not exc.connection_invalidated
        )
    return bool(exc.connection_invalidated) or sqlstate in _AWAY_SQLSTATES


def is_damaged(exc: BaseException) -> bool:
    """Tell a damaged database (an outage to ``is_unavailable``) that no wait will end.

    SQLite's corrupt file or one that is not a database (SQLITE_CORRUPT,
    SQLITE_NOTADB), PostgreSQL's damaged page or index (XX001, XX002): an
    operator must restore it, so it is logged as an ERROR, not among the
    outages that pass by themselves.
    """
    return driver_error_in(exc, sqlite_codes=_SQLITE_DAMAGED, sqlstates=_CORRUPTED)


def driver_error_in(
    exc: BaseException, *, sqlite_codes: Collection[int], sqlstates: Collection[str]
) -> bool:
    """Tell a driver's error by its SQLite primary result code or its PostgreSQL SQLSTATE."""
    if not isinstance(exc, DBAPIError):
        return False
    code = getattr(exc.orig, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in sqlite_codes
    return getattr(exc.orig, "sqlstate", None) in sqlstates


def damage_message(exc: BaseException) -> str:
    """The log line of a damaged database, naming the driver's error."""
    return f"the database is damaged; restore it from a backup: {getattr(exc, 'orig', None) or exc}"


def is_conflict(exc: BaseException) -> bool:
    """Tell a transaction rolled back for a race with another (a deadlock, a serialization failure).

    SQLSTATE 40P01 or 40001, on a connection still open: the database is
    there, the transaction lost to a concurrent one. Run again at once, it
    is expected to pass (``retrying_conflicts``).
    """
    return (
        isinstance(exc, DBAPIError)
        and not exc.connection_invalidated
        and getattr(exc.orig, "sqlstate", None) in _CONFLICT_SQLSTATES
    )


def retrying_conflicts(
    work: Callable[[], Result], *, attempts: int = CONFLICT_ATTEMPTS, what: str = "transaction"
) -> Result:
    """Run ``work``, again at once while it loses a race (is_conflict): ``attempts`` times at most.

    ``work`` must be a whole unit of work that commits or raises with
    nothing committed it would not find again, so that running it again is
    safe: ``inbox.receive_many`` (the one place that retries). A conflict
    that outlasts the attempts is raised, and answered as a busy database
    (``is_unavailable``: 503, a broker's back-off). Each retry logs one
    WARNING (``retrying``), with the error.
    """
    attempt = 1
    while True:
        try:
            return work()
        except DBAPIError as exc:
            if attempt >= attempts or not is_conflict(exc):
                raise
            attempt += 1
            log.warning(
                "%s lost a race with another (%s), retrying at once (attempt %d of %d)",
                what,
                str(exc.orig).splitlines()[0] if exc.orig else exc,
                attempt,
                attempts,
                extra={"sqlstate": getattr(exc.orig, "sqlstate", None), "attempt": attempt},
            )


def _postgresql_connect_params(
    statement_timeout: float, *, transaction_pooler: bool
) -> Callable[..., None]:
    """A ``do_connect`` listener: keepalives and the statement timeout on each new connection.

    Added to what the URL and ``connect_args`` say, never in their place: a
    value given there (a test's ``options``, a URL's ``keepalives_idle``)
    wins. Behind a transaction pooler no ``options`` are sent (pgbouncer
    refuses the startup parameter); the timeout is then the role's
    (``ALTER ROLE ... SET statement_timeout``, docs/scaling.md).
    """
    milliseconds = round(statement_timeout * 1000)

    def on_connect(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        for name, value in POSTGRESQL_KEEPALIVES.items():
            cparams.setdefault(name, value)
        if milliseconds <= 0 or transaction_pooler:
            return
        options = str(cparams.get("options") or "")
        if "statement_timeout" not in options:
            cparams["options"] = f"{options} -c statement_timeout={milliseconds}".strip()

    return on_connect


@contextmanager
def stall_watch(what: str, after: float | None = None, **fields: Any) -> Iterator[None]:
    """Log one warning if the block is still running after ``after`` seconds.

    Wrap a database call that should be quick (a worker's claim, a broker
    batch's store) with ``with stall_watch("claim"):``. Past ``after``
    seconds (by default the app's ``DATABASE_STALL_WARNING_SECONDS``, else
    5), one WARNING from ``webhook_receiver.database``, "database stalled",
    with ``extra`` fields ``what``, ``stalled_seconds`` and ``fields``
    (names that are not LogRecord attributes); when a block that stalled
    ends, one INFO line with how long it took. Blocks of one kind (the same
    ``what`` and ``fields``) that stall together, as a worker's threads'
    claims do, are one stall: said once, and ended by the last. The
    block's exceptions pass through untouched. Costs two lock round trips
    when nothing stalls: one watchdog thread per process times every block.
    """
    if after is None:
        after = _stall_warning_seconds()
    watch = _Watch(what, after, fields)
    _WATCHDOG.add(watch)
    try:
        yield
    finally:
        if _WATCHDOG.remove(watch):
            elapsed = time.monotonic() - watch.started
            log.info(
                "database call finished after stalling: %s took %.1f s",
                what,
                elapsed,
                extra={**fields, "what": what, "stalled_seconds": round(elapsed, 3)},
            )


def _stall_warning_seconds() -> float:
    if has_app_context():
        return float(
            current_app.config.get("DATABASE_STALL_WARNING_SECONDS", STALL_WARNING_SECONDS)
        )
    return STALL_WARNING_SECONDS


class _Watch:
    __slots__ = ("what", "fields", "started", "deadline", "stalled", "said")

    def __init__(self, what: str, after: float, fields: dict[str, Any]) -> None:
        self.what = what
        self.fields = fields
        self.started = time.monotonic()
        self.deadline = self.started + after
        self.stalled = False  # past its deadline
        self.said = False  # the stall of its kind said, its end to be said

    def same_kind(self, other: _Watch) -> bool:
        return self.what == other.what and self.fields == other.fields


class _Watchdog:
    """One thread per process that times every open ``stall_watch`` block.

    A thread per block (threading.Timer) would cost a thread start per claim;
    this keeps the open blocks in a set and sleeps until the earliest
    deadline among them.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        # Also in a forked child, where the parent's lock may have been held
        # by the parent's watchdog thread, which the child does not have.
        self._changed = threading.Condition(threading.Lock())
        self._open: set[_Watch] = set()
        self._wake_at = float("inf")
        self._pid = 0

    def add(self, watch: _Watch) -> None:
        with self._changed:
            if self._pid != os.getpid():  # first use, or a forked child: no thread yet
                self._pid = os.getpid()
                self._wake_at = float("inf")
                threading.Thread(target=self._run, name="stall-watch", daemon=True).start()
            self._open.add(watch)
            if watch.deadline < self._wake_at:
                self._changed.notify()

    def remove(self, watch: _Watch) -> bool:
        """Close the block's watch; tell whether the end of its stall is to be said."""
        with self._changed:
            self._open.discard(watch)
            if not watch.said:
                return False
            for other in self._open:
                if other.stalled and other.same_kind(watch):
                    other.said = True  # the stall goes on: the last of its kind ends it
                    return False
            return True

    def _run(self) -> None:
        while True:
            with self._changed:
                now = time.monotonic()
                due = []
                for watch in [w for w in self._open if not w.stalled and w.deadline <= now]:
                    watch.stalled = True
                    if not any(w.said and w.same_kind(watch) for w in self._open):
                        watch.said = True
                        due.append(watch)
                waiting = [w.deadline for w in self._open if not w.stalled]
                self._wake_at = min(waiting, default=float("inf"))
                if not due:
                    timeout = None if not waiting else max(self._wake_at - now, 0.0)
                    self._changed.wait(timeout)
                    continue
            for watch in due:  # logged outside the lock: a handler may be slow
                elapsed = now - watch.started
                log.warning(
                    "database stalled: %s still running after %.1f s",
                    watch.what,
                    elapsed,
                    extra={
                        **watch.fields,
                        "what": watch.what,
                        "stalled_seconds": round(elapsed, 3),
                    },
                )


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG._reset)


def init_app(app: Flask) -> None:
    """Attach the SQLite tuning, or PostgreSQL's keepalives and statement timeout, to the engine."""
    with app.app_context():
        engine: Engine = db.engine
        if engine.dialect.name == "postgresql":
            event.listen(
                engine,
                "do_connect",
                _postgresql_connect_params(
                    float(app.config.get("DATABASE_STATEMENT_TIMEOUT_SECONDS", 0)),
                    transaction_pooler=bool(app.config.get("TRANSACTION_POOLER")),
                ),
            )
        if engine.dialect.name == "sqlite":
            event.listen(engine, "connect", _on_sqlite_connect)
            event.listen(engine, "begin", _on_sqlite_begin)
            if not event.contains(Session, "after_begin", _take_pending_turn):
                event.listen(Session, "after_begin", _take_pending_turn)


@contextmanager
def unit_of_work(
    session: Session | scoped_session[Any] | None = None,
) -> Iterator[Session | scoped_session[Any]]:
    """Commit the block's writes as one transaction, or roll back and re-raise.

    The one way a session's writes commit. On SQLite the transaction runs in
    the writers' turn (see SQLiteWriterTurns), so every writer waits for the
    write lock the same way. The turn is taken when the block's transaction
    begins, at its first statement, not when the block opens: the Python
    work before it (parsing, hashing) keeps no other writer waiting.
    """
    session = session or db.session
    engine = db.engine
    turn = _LazyTurn(engine) if engine.dialect.name == "sqlite" else None
    if turn is not None and _begun(session):
        turn.take()  # the block continues a transaction that has already begun
    token = _PENDING_TURN.set(turn)
    try:
        yield session
        if not untouched(session):
            session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        _PENDING_TURN.reset(token)
        if turn is not None:
            turn.release()


def untouched(session: Session | scoped_session[Any]) -> bool:
    """True if nothing went through ``session``: no transaction began, nothing is pending.

    Its commit would write nothing; skipping it skips SQLAlchemy's
    machinery too (a unit of work whose writes went past the session).
    """
    if isinstance(session, scoped_session):
        if not session.registry.has():
            return True  # not even made
        current: Session = session()
    else:
        current = session
    return not (current.in_transaction() or current.new or current.dirty or current.deleted)


def _begun(session: Session | scoped_session[Any]) -> bool:
    return (session() if isinstance(session, scoped_session) else session).in_transaction()


class _LazyTurn:
    """A unit of work's writers' turn, taken when its transaction begins."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._held: AbstractContextManager[None] | None = None

    def take(self) -> None:
        if self._held is None:
            held = writer_turn(self._engine)
            held.__enter__()
            self._held = held

    def release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.__exit__(None, None, None)


# The unit of work running in this thread (or task), whose turn is due.
_PENDING_TURN: ContextVar[_LazyTurn | None] = ContextVar("pending_writer_turn", default=None)


def _take_pending_turn(_session: Session, _transaction: Any, _connection: Connection) -> None:
    # The session's transaction begins (its first statement is next): on
    # SQLite the BEGIN is deferred, so no snapshot is taken before the turn.
    turn = _PENDING_TURN.get()
    if turn is not None:
        turn.take()


@contextmanager
def transaction(engine: Engine | None = None) -> Iterator[Connection]:
    """A Core transaction on ``engine`` (the app's by default), in the writers' turn on SQLite.

    Commits at the end of the block, or rolls back and re-raises. For a
    unit of work that writes without the session: the inbox's batches, the
    conflicts it keeps, the redeliveries' bookkeeping.
    """
    engine = engine or db.engine
    with writer_turn(engine), engine.begin() as connection:
        yield connection


def autocommit_connection() -> Connection:
    """A pooled connection outside any transaction: each statement commits on its own.

    For a lone read (no BEGIN and no ROLLBACK around it), and on PostgreSQL
    for one statement that must commit durably before it returns.
    """
    connection = db.engine.connect()
    if connection.dialect.name == "sqlite":
        return connection.execution_options(**{_NO_BEGIN: True})
    return connection.execution_options(isolation_level="AUTOCOMMIT")


@contextmanager
def write_transaction(connection: Connection) -> Iterator[Connection]:
    """Run the block on a connection of ``autocommit_connection()`` as one transaction.

    For a write that follows a lone read on the same connection (one pool
    checkout, no session): the block's statements commit together at its
    end, or roll back if it raises. On SQLite the transaction opens with the
    block's first statement, which must be its write.
    """
    connection.commit()  # end the reads' autocommit scope; nothing to commit
    if connection.dialect.name == "sqlite":
        connection.execution_options(**{_NO_BEGIN: False})
    else:
        connection.execution_options(isolation_level=connection.default_isolation_level)
    with writer_turn(connection.engine):
        try:
            yield connection
            connection.commit()
        except BaseException:
            connection.rollback()
            raise


class SQLiteWriterTurns:
    """Writers to one SQLite file take turns through an flock on a file beside it.

    A writer that finds SQLite's write lock taken polls for it: the busy
    handler sleeps 1, 2, 5, 10, 15, 20, 25 ms... between tries, so under
    several gunicorn workers a write that waits loses milliseconds while the
    holder needs a fraction of one (p99 latencies of tens of ms in
    bench/README.md). Waiting for the turn polls in steps of 50 µs to 1 ms
    instead, and the turn ends the moment its holder's commit does. Writers
    that take no turn still meet SQLite's own lock and busy timeout, as
    before; a killed holder's turn ends with it. Waiting for a turn is
    bounded by the same busy timeout, then it fails as a locked database.
    """

    def __init__(self, database_path: str) -> None:
        self.path = database_path + "-writers.lock"
        self._fd: int | None = None
        self._pid = 0
        # The flock is the process's; threads of one process (a request and
        # the duplicates' batch writer) take turns through this lock, and a
        # turn taken inside a turn by the same thread is the same turn.
        self._threads = threading.RLock()
        self._depth = 0

    def open(self) -> None:
        """Open the lock file for this process, once; raise OSError if it cannot be."""
        if self._pid == os.getpid():
            return
        with _OPENING:  # the request thread and the batch writer's, at once
            if self._pid != os.getpid():
                self._open()

    def _open(self) -> None:
        # An flock belongs to the open file, shared by the processes that
        # inherit its descriptor: each process (each worker) opens its own,
        # and starts with no thread holding the turn. The file is created
        # like SQLite's own: the umask decides who may share it.
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        self._threads = threading.RLock()
        self._depth = 0
        self._pid = os.getpid()

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the writers' turn for the block (after ``open()``)."""
        assert self._pid == os.getpid()
        deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
        if not self._threads.acquire(timeout=SQLITE_BUSY_TIMEOUT_MS / 1000):
            raise _locked()
        try:
            if self._depth == 0:
                self._wait_for_turn(deadline)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)  # type: ignore[arg-type]
        finally:
            self._threads.release()

    def _wait_for_turn(self, deadline: float) -> None:
        assert self._fd is not None
        delay = 0.00005
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise _locked() from None
                time.sleep(delay)
                delay = min(delay * 2, 0.001)


def _locked() -> OperationalError:
    # What SQLite itself says past its busy timeout: answered as a 503.
    return OperationalError(
        "waiting for the writers' turn", None, sqlite3.OperationalError("database is locked")
    )


_TURNS: dict[str, SQLiteWriterTurns] = {}
_OPENING = threading.Lock()


def writer_turn(engine: Engine | None = None) -> AbstractContextManager[None]:
    """Take the writers' turn on the SQLite file (of ``engine``, else the app's); else nothing."""
    engine = engine or db.engine
    path = engine.url.database
    if engine.dialect.name != "sqlite" or not path or path == ":memory:":
        return nullcontext()
    turns = _TURNS.get(path)
    if turns is None:
        turns = _TURNS[path] = SQLiteWriterTurns(path)
    try:
        turns.open()
    except OSError:
        # The lock file cannot be opened (a read-only folder, another user's
        # file): SQLite's own lock still keeps writes apart, only slower.
        log.warning("cannot take turns through %s; writing without", turns.path, exc_info=True)
        return nullcontext()
    return turns.turn()


def dialect_insert(table: Any, engine: Engine | None = None) -> Any:
    """An INSERT of the dialect of ``engine`` (the app's by default): it knows ``ON CONFLICT``."""
    name = (engine or db.engine).dialect.name
    if name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(table)
    if name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table)
    raise NotImplementedError(f"SQLite and PostgreSQL are supported, not {name}")


def insert_ignoring_conflicts(table: Any, index_elements: list[str]) -> Any:
    """An INSERT that does nothing when the unique constraint on ``index_elements`` is hit."""
    return dialect_insert(table).on_conflict_do_nothing(index_elements=index_elements)


def is_sqlite() -> bool:
    """Tell whether the app's database is SQLite."""
    return db.engine.dialect.name == "sqlite"


def end_read() -> None:
    """End a read before a write, where the database needs it.

    SQLite cannot upgrade a read transaction to a write once another
    connection has committed (SQLITE_BUSY_SNAPSHOT, with no waiting), so the
    read is ended and the write opens its own transaction. PostgreSQL writes
    fine after a read, and the extra round trip would be waste.
    """
    if is_sqlite():
        db.session.rollback()


def commit_without_waiting_for_disk() -> None:
    """Let the current transaction's commit return before its WAL reaches the disk.

    Only for claims whose loss in a crash is harmless: the claim is redone
    by the next attempt, and the durable commit that follows it (the effect
    and the saved result) flushes the log past it anyway, in order. This
    saves one disk flush per new key on PostgreSQL; SQLite cannot change its
    safety level inside a transaction, and its flush is cheap.
    """
    if not is_sqlite():
        db.session.execute(text("SET LOCAL synchronous_commit TO off"))
