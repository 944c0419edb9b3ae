"""Statements compiled once by SQLAlchemy and run straight on the driver's cursor.

The receipt of one message is the hottest path of the service, and on it
SQLAlchemy's per-execution machinery (events, execution contexts, result
wrappers) cost more CPU than the statements themselves (bench/README.md).
A :class:`DriverStatement` keeps what matters of SQLAlchemy (it writes the
SQL and converts each value through the columns' own types: JSON, UTC
datetimes, arrays) and skips the rest. The contract tests in
``tests/inbox/test_inbox.py`` hold it to that: a row stored through
here equals the row the plain Core path stores.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Generic, TypeVar

from sqlalchemy import DateTime, select
from sqlalchemy.engine import Connection, Engine

from .database import driver_errors


class FastPathError(TypeError):
    """A statement uses a feature that only SQLAlchemy's own execution would honour."""


class DriverStatement:
    """A Core statement compiled for one dialect, with its binds' converters."""

    def __init__(
        self, statement: Any, dialect: Any, column_keys: Iterable[str] | None = None
    ) -> None:
        compiled = statement.compile(
            dialect=dialect, column_keys=list(column_keys) if column_keys else None
        )
        # Only what is passed in is sent: a statement that needs Python-side
        # defaults, expanding IN lists or renamed binds would be sent wrong.
        if compiled.insert_prefetch:
            raise FastPathError(f"Python-side defaults are not sent: {compiled.insert_prefetch}")
        if compiled.literal_execute_params:
            raise FastPathError("literal-execute parameters are not supported")
        if compiled.escaped_bind_names:
            raise FastPathError(f"escaped bind names: {compiled.escaped_bind_names}")
        expanding = [name for name, b in compiled.binds.items() if b.expanding]
        if expanding:
            raise FastPathError(f"expanding IN parameters are not supported: {expanding}")
        self.sql = str(compiled)
        # qmark (SQLite) binds by position, pyformat (psycopg) by name.
        self._positional = compiled.positiontup is not None
        names = compiled.positiontup if self._positional else list(compiled.binds)
        # (name, key, converter, constant): a value written into the
        # statement (``state = 'in_progress'``) has no key and is converted
        # once; the others come from ``params()``'s values.
        self._binds: list[tuple[str, str | None, Any, Any]] = []
        # Binds of times: rows of a batch mostly share theirs (see rows_params).
        self._times: set[str] = set()
        for name in names or ():
            bind = compiled.binds[name]
            if bind.callable is not None:
                raise FastPathError(f"bind {bind.key!r} takes its value from a callable")
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if bind.required:
                self._binds.append((name, bind.key, process, None))
                # UTCDateTime (a TypeDecorator) converts through its DateTime impl.
                if process is not None and isinstance(
                    getattr(bind.type, "impl", bind.type), DateTime
                ):
                    self._times.add(name)
            else:
                constant = bind.value if process is None else process(bind.value)
                self._binds.append((name, None, None, constant))

    def params(self, values: Mapping[str, Any]) -> Any:
        """The statement's parameters, converted from ``values`` (keyed by bind key)."""
        converted = []
        for name, key, process, constant in self._binds:
            if key is None:
                converted.append((name, constant))
            else:
                value = values[key]
                converted.append((name, value if process is None else process(value)))
        if self._positional:
            return tuple(value for _, value in converted)
        return dict(converted)

    def rows_params(self, rows: Iterable[Mapping[str, Any]]) -> list[Any]:
        """Positional parameters of ``rows``, one after another (a multi-row VALUES).

        Each distinct time is converted once: a batch's rows mostly share
        their receipt's.
        """
        if not self._positional:
            raise FastPathError("rows_params is for positional (qmark) statements")
        times: dict[str, dict[Any, Any]] = {name: {} for name in self._times}
        flat: list[Any] = []
        append = flat.append
        for row in rows:
            for name, key, process, constant in self._binds:
                if key is None:
                    append(constant)
                    continue
                value = row[key]
                if process is None:
                    append(value)
                elif name in times:
                    converted = times[name]
                    if value not in converted:
                        converted[value] = process(value)
                    append(converted[value])
                else:
                    append(process(value))
        return flat


Built = TypeVar("Built")


class PerEngine(Generic[Built]):
    """What ``build`` makes of an engine (its statements), built once per engine, on first use.

    Each engine its own: the tests run apps on both databases. Hand out the
    bound ``get`` as the module's function: it is called per message, and a
    wrapper around it would be one call more.
    """

    def __init__(self, build: Callable[[Engine], Built]) -> None:
        self._build = build
        self._built: weakref.WeakKeyDictionary[Engine, Built] = weakref.WeakKeyDictionary()
        self._building = threading.Lock()

    def get(self, engine: Engine) -> Built:
        """``engine``'s, built now if this is its first use (by one thread, the others wait)."""
        built = self._built.get(engine)
        if built is None:
            with self._building:
                built = self._built.get(engine)
                if built is None:
                    built = self._built[engine] = self._build(engine)
        return built


def insert_unless_stored(
    table: Any, row: Mapping[str, Any], stored: Any, unique: list[str], name: str
) -> Any:
    """PostgreSQL: a CTE that inserts ``row`` (column: value) only when ``stored`` found none.

    The insert of a one-statement read-or-insert: the CTE ``stored`` reads
    what is under the key, this one inserts only when nothing is, and
    ``ON CONFLICT DO NOTHING`` on the ``unique`` columns leaves a copy
    committed after the statement's snapshot alone. It returns the new
    row's ``id``, none when it made no row.
    """
    from sqlalchemy.dialects import postgresql

    new_row = select(*row.values()).where(~select(stored.c.id).exists())
    return (
        postgresql.insert(table)
        .from_select(list(row), new_row)
        .on_conflict_do_nothing(index_elements=unique)
        .returning(table.c.id)
        .cte(name)
    )


@contextmanager
def driver_cursor(engine: Engine) -> Iterator[Any]:
    """A cursor of a pooled connection outside any transaction, for DriverStatements.

    Each statement is its own transaction, durable when it returns (the
    SQLite driver runs in autocommit mode, see database._on_sqlite_connect;
    psycopg is switched to it for the block). Driver errors come out as
    SQLAlchemy's, so a database that is away or locked is a 503 like
    everywhere else, and a dead connection leaves the pool. Inside
    ``one_connection`` the block's connection serves every cursor.
    """
    pinned = _PINNED.get()
    if pinned is not None and pinned[0] is engine:
        with _cursor(engine, pinned[1]) as cursor:
            yield cursor
        return
    with _autocommit_connection(engine) as pooled, _cursor(engine, pooled) as cursor:
        yield cursor


@contextmanager
def _cursor(engine: Engine, pooled: Any) -> Iterator[Any]:
    """A cursor of ``pooled``'s driver connection, closed after the block."""
    with driver_errors(engine, lambda: pooled):
        cursor = pooled.driver_connection.cursor()
        try:
            yield cursor
        finally:
            # Closing ends the statement: on SQLite an autocommitted
            # statement commits only once it is finished.
            cursor.close()


@contextmanager
def one_connection(engine: Engine) -> Iterator[None]:
    """Serve every ``driver_cursor`` of the block from one pooled connection.

    For a unit of work made of lone statements (the API's read of its key,
    then its one-statement write): one pool checkout, not one each. Only
    on PostgreSQL, where that unit of work is made so (``inbox.holding``);
    on SQLite the block's cursors are taken one by one, as outside it.
    """
    if engine.dialect.name != "postgresql":
        yield
        return
    with _autocommit_connection(engine) as pooled:
        token = _PINNED.set((engine, pooled))
        try:
            yield
        finally:
            _PINNED.reset(token)


# The connection of the innermost ``one_connection`` block, with its engine.
_PINNED: ContextVar[tuple[Engine, Any] | None] = ContextVar("pinned_connection", default=None)


@contextmanager
def _autocommit_connection(engine: Engine) -> Iterator[Any]:
    """A pooled driver connection in autocommit mode, for the block."""
    postgresql = engine.dialect.name == "postgresql"
    pooled = None
    try:
        with driver_errors(engine, lambda: pooled):
            pooled = engine.raw_connection()  # a refused connection raises here too
            if postgresql:
                pooled.driver_connection.autocommit = True  # type: ignore[union-attr]
        yield pooled
    finally:
        if pooled is not None:
            if postgresql and pooled.is_valid:
                pooled.driver_connection.autocommit = False  # type: ignore[union-attr]
            pooled.close()


@contextmanager
def transaction_cursor(connection: Connection) -> Iterator[Any]:
    """A driver cursor inside ``connection``'s transaction (a session's): it commits with it.

    For DriverStatements in a unit of work, where SQLAlchemy's execution
    would cost more than the statement; errors come out as SQLAlchemy's,
    as from ``driver_cursor``.
    """
    with driver_errors(connection.engine, lambda: connection):
        cursor = connection.connection.cursor()
        try:
            yield cursor
        finally:
            cursor.close()
