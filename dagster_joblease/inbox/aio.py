"""The inbox for async code on PostgreSQL: the same semantics, statements and transaction as :mod:`.sync`.

Two sources of connections:

- SQLAlchemy's async engine (``create_async_engine("postgresql+psycopg://…")``): the effect gets the
  transaction's ``sqlalchemy.ext.asyncio.AsyncConnection``;
- psycopg 3 directly: a callable that returns an async context manager yielding a
  ``psycopg.AsyncConnection``, such as ``psycopg_pool.AsyncConnectionPool(...).connection``; the effect
  gets that connection (any row factory; autocommit or not: the inbox opens its own transaction).

SQLite has no async path here: use the sync :class:`~dagster_joblease.inbox.Inbox` (the ASGI middleware
runs it in a worker thread).
"""

from __future__ import annotations

import abc
import logging
import sys
from collections.abc import Awaitable, Callable, Generator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, overload

import psycopg
import psycopg.errors
import psycopg.rows

from dagster_joblease import errors
from dagster_joblease.inbox import core
from dagster_joblease.inbox.core import Answer, InboxResult, VerdictKind
from dagster_joblease.storage import inbox as store
from dagster_joblease.storage.driver import Query
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.schema import inbox_table

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["AsyncInbox", "AsyncInboxTransaction", "PsycopgConnector"]

logger = logging.getLogger(__name__)

#: Where psycopg connections come from: e.g. ``psycopg_pool.AsyncConnectionPool(...).connection``.
PsycopgConnector = Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]]

C = TypeVar("C")


class _Session(abc.ABC):
    """One async connection with a transaction open on it: run statements, then commit or roll back."""

    connection: Any

    @abc.abstractmethod
    async def open(self) -> None:
        """Check a connection out and begin its transaction."""

    @abc.abstractmethod
    async def first(self, query: Query, params: dict[str, Any]) -> Any:
        """The first row of ``query`` (which returns rows), or None."""

    @abc.abstractmethod
    async def count(self, query: Query, params: dict[str, Any]) -> int:
        """Run ``query`` (which returns no rows); how many rows it changed."""

    @abc.abstractmethod
    async def end(self, commit: bool) -> None:
        """Commit (``commit``) or roll back, and give the connection back."""

    async def record(self, params: dict[str, Any]) -> bool:
        """Store the key's answer (:data:`~dagster_joblease.storage.inbox.RECORD_DONE`) and commit it
        with the effect: True. False when another transaction recorded the key first: nothing committed,
        the caller rolls back. The connection stays checked out until :meth:`end`."""
        if await self.first(store.RECORD_DONE, params) is None:
            return False
        await self.connection.commit()
        return True

    async def run(self, batch: core.Batch) -> tuple[Any, ...]:
        """Each statement of ``batch`` in order: its first row (returning rows) or rowcount."""
        return tuple([await self._one(query, params) for query, params in batch])

    async def _one(self, query: Query, params: dict[str, Any]) -> Any:
        return await (self.first(query, params) if query.returns_rows else self.count(query, params))


class _EngineSession(_Session):
    def __init__(self, engine: Any) -> None:
        self._engine = engine

    async def open(self) -> None:
        self.connection = await self._engine.connect()
        try:
            await self.connection.begin()
        except BaseException:
            await self.connection.close()
            raise

    async def first(self, query: Query, params: dict[str, Any]) -> Any:
        return (await self.connection.execute(query.postgresql, params)).first()

    async def count(self, query: Query, params: dict[str, Any]) -> int:
        return int((await self.connection.execute(query.postgresql, params)).rowcount)

    async def end(self, commit: bool) -> None:
        try:
            await (self.connection.commit() if commit else self.connection.rollback())
        finally:
            await self.connection.close()


class _PsycopgSession(_Session):
    """A psycopg connection: each batch of the key's statements (and the answer's row with the COMMIT)
    goes as one query string, bound client-side (psycopg's ``AsyncClientCursor``), in one round trip.

    Several statements in one simple query still run one after another, each with its own snapshot in
    READ COMMITTED (so the key's read follows its lock), and the first error skips the rest. That costs
    far less CPU in the process than psycopg's pipeline mode, which made the receiver's first apply spend
    more in psycopg than in everything else. The connection runs in autocommit mode while the inbox has
    it (the transaction is the inbox's own BEGIN ... COMMIT, so psycopg adds no BEGIN round trip of its
    own), and gets its own mode back when it is given back.
    """

    def __init__(self, connector: PsycopgConnector) -> None:
        self._manager = connector()

    async def open(self) -> None:
        conn = self.connection = await self._manager.__aenter__()
        try:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                raise errors.ConfigurationError(
                    "the psycopg connection the inbox was given is inside a transaction; give the inbox "
                    "idle connections (a pool's connection() is)"
                )
            self._autocommit = conn.autocommit
            if not self._autocommit:
                await conn.set_autocommit(True)
            self._begin = True  # BEGIN goes with the first batch
            # psycopg's cursor classes themselves, not conn.cursor(): the connection's cursor factory may
            # bind differently (RawCursor's $1), its row factory may be dicts.
            self._client = psycopg.AsyncClientCursor(conn, row_factory=psycopg.rows.tuple_row)
        except BaseException as exc:
            await self._manager.__aexit__(type(exc), exc, exc.__traceback__)
            raise

    async def _started(self) -> psycopg.AsyncCursor[Any]:
        """A cursor binding server-side (for statements outside the key's batches: purge), after BEGIN."""
        cursor = psycopg.AsyncCursor(self.connection, row_factory=psycopg.rows.tuple_row)
        if self._begin:
            self._begin = False
            await cursor.execute("BEGIN")
        return cursor

    async def first(self, query: Query, params: dict[str, Any]) -> Any:
        cursor = await self._started()
        await cursor.execute(query.sql, query.args(params))
        rows = await cursor.fetchall()
        return rows[0] if rows else None

    async def count(self, query: Query, params: dict[str, Any]) -> int:
        cursor = await self._started()
        await cursor.execute(query.sql, query.args(params))
        return int(cursor.rowcount)

    async def run(self, batch: core.Batch) -> tuple[Any, ...]:
        """BEGIN (if due) and every statement of the batch in one query string: one round trip, each
        still a statement of its own (its own snapshot in READ COMMITTED); the first error skips the rest."""
        sql = [query.sql for query, _ in batch]
        args = [arg for query, params in batch for arg in query.args(params)]
        cursor = self._client
        begin, self._begin = self._begin, False
        await cursor.execute(";".join(["BEGIN", *sql] if begin else sql), args)
        if begin:
            cursor.nextset()
        results: list[Any] = []
        for index, (query, _) in enumerate(batch):
            if index:
                cursor.nextset()
            results.append(await cursor.fetchone() if query.returns_rows else int(cursor.rowcount))
        return tuple(results)

    async def record(self, params: dict[str, Any]) -> bool:
        """The answer's row and the COMMIT in one query string (one round trip). The row is
        :data:`~dagster_joblease.storage.inbox.RECORD_NEW` (no ``ON CONFLICT``): a key recorded first fails
        it with a unique violation on the inbox table, the server skips the COMMIT behind it, and this
        returns False with the transaction failed (the caller rolls back). Any other error raises."""
        query = store.RECORD_NEW
        try:
            await self._client.execute(query.sql + ";COMMIT", query.args(params))
        except psycopg.errors.UniqueViolation as exc:
            if exc.diag.table_name != inbox_table.name:
                raise  # the effect's own constraint (a deferred one fails at COMMIT): not the key's record
            return False
        return True

    async def end(self, commit: bool) -> None:
        conn = self.connection
        try:
            await (conn.commit() if commit else conn.rollback())
            if not self._autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                await conn.set_autocommit(False)
        finally:
            await self._manager.__aexit__(None, None, None)


async def _drive(session: _Session, steps: Generator[core.Batch, Any, Any]) -> Any:
    try:
        batch = next(steps)
        while True:
            batch = steps.send(await session.run(batch))
    except StopIteration as stop:
        return stop.value


class AsyncInboxTransaction(Generic[C]):
    """One key's transaction, in three awaits: :meth:`begin`, then :meth:`commit` or :meth:`rollback`
    (the async twin of :class:`~dagster_joblease.inbox.InboxTransaction`)."""

    def __init__(
        self, inbox: AsyncInbox[C], key: str, fingerprint: str, fence: int | None, scope: str | None = None
    ) -> None:
        self.inbox = inbox
        self.key = key
        self.fingerprint = fingerprint
        self.fence = fence
        self.scope = scope
        #: What the key's record is stored (and locked) under (see :class:`InboxTransaction`).
        self.record_key = core.record_key(key, scope)
        self._session: _Session | None = None

    @property
    def connection(self) -> C:
        """The transaction's connection: write the effect here so it commits with the stored answer."""
        if self._session is None:
            raise errors.ConfigurationError("the inbox transaction is not open: begin() returned an answer")
        return cast(C, self._session.connection)

    async def begin(self) -> InboxResult | None:
        """Open the transaction and judge the key: the replay, None (apply the effect), or a refusal
        (the same errors as :meth:`InboxTransaction.begin`)."""
        inbox = self.inbox
        session = inbox._session()
        steps = core.begin_steps("postgresql", self.record_key, self.fingerprint, self.fence, inbox.lock_ms)
        with translate_errors("process an inbox key"):
            await session.open()
            try:
                verdict, row = await _drive(session, steps)
            except BaseException:
                await session.end(commit=False)
                raise
            if verdict.kind in (VerdictKind.APPLY, VerdictKind.APPLY_AFTER_EXPIRY):
                self._session = session
                return None
            await session.end(commit=True)  # a read (and maybe a newer fencing number): nothing to undo
        core.raise_refusal(self.key, self.fence, verdict)
        return core.stored_result(row)

    async def commit(self, answer: Answer) -> InboxResult:
        """Record ``answer`` and commit it with the effect (see :meth:`InboxTransaction.commit`)."""
        session = self._session
        if session is None:
            raise errors.ConfigurationError("the inbox transaction is not open: begin() returned an answer")
        params = core.record_params(self.record_key, self.fingerprint, self.fence, answer)
        try:
            with translate_errors("record an inbox result"):
                recorded = await session.record(params)
                if recorded:
                    self._session = None
                    await session.end(commit=True)  # committed: gives the connection back
        except BaseException:
            await self.rollback()
            raise
        if not recorded:
            await self.rollback()
            return await self._look_again()
        logger.debug("inbox key %r processed (status %d)", self.key, answer.status_code)
        return InboxResult(answer.status_code, answer.body, False, answer.headers)

    async def rollback(self) -> None:
        """Roll the transaction and the effect back: the key stays new."""
        session, self._session = self._session, None
        if session is not None:
            with translate_errors("roll back an inbox transaction"):
                await session.end(commit=False)

    async def _look_again(self) -> InboxResult:
        again = AsyncInboxTransaction(self.inbox, self.key, self.fingerprint, self.fence, self.scope)
        replay = await again.begin()
        if replay is None:
            await again.rollback()
            raise errors.InboxInProgressError(idempotency_key=self.key)
        return replay


def _is_async_engine(source: object) -> bool:
    """Whether ``source`` is SQLAlchemy's ``AsyncEngine``, without importing ``sqlalchemy.ext.asyncio``
    (which needs greenlet) when nothing did: an AsyncEngine cannot exist before that module is imported,
    so an inbox on a psycopg pool never needs greenlet."""
    module = sys.modules.get("sqlalchemy.ext.asyncio")
    return module is not None and isinstance(source, module.AsyncEngine)


class AsyncInbox(Generic[C]):
    """The inbox for asyncio code on PostgreSQL (same semantics and errors as :class:`Inbox`).

    Args:
        source: SQLAlchemy's ``AsyncEngine`` (PostgreSQL), or a callable returning an async context
            manager that yields a psycopg ``AsyncConnection`` (``pool.connection`` of a
            ``psycopg_pool.AsyncConnectionPool``).
        lock_ms: as for :class:`Inbox`.

    Example::

        pool = psycopg_pool.AsyncConnectionPool("postgresql://…", open=False)
        inbox = AsyncInbox(pool.connection)

        async def apply(conn: psycopg.AsyncConnection) -> tuple[int, str]:
            await conn.execute("INSERT INTO orders ...", (...))
            return 201, '{"created": true}'

        result = await inbox.process(key, body, apply)
    """

    @overload
    def __init__(self: AsyncInbox[Any], source: AsyncEngine, *, lock_ms: int = ...) -> None: ...

    @overload
    def __init__(
        self: AsyncInbox[psycopg.AsyncConnection[Any]], source: PsycopgConnector, *, lock_ms: int = ...
    ) -> None: ...

    def __init__(self, source: Any, *, lock_ms: int = core.DEFAULT_LOCK_MS) -> None:
        self.lock_ms = core.check_lock_ms(lock_ms)
        self.source = source
        if _is_async_engine(source):
            if source.dialect.name != "postgresql":
                raise errors.ConfigurationError(
                    f"AsyncInbox needs PostgreSQL, not {source.dialect.name}; on SQLite use the sync Inbox "
                    "(InboxMiddleware runs it in a worker thread)"
                )
            self._make_session: Callable[[], _Session] = lambda: _EngineSession(source)
        elif callable(source):
            self._make_session = lambda: _PsycopgSession(source)
        else:
            raise errors.ConfigurationError(
                f"AsyncInbox source {source!r:.80} is neither an AsyncEngine nor a callable that returns an "
                "async context manager of psycopg AsyncConnections (e.g. AsyncConnectionPool.connection)"
            )

    def _session(self) -> _Session:
        return self._make_session()

    def transaction(
        self, key: str, fingerprint: str, fence: int | None = None, *, scope: str | None = None
    ) -> AsyncInboxTransaction[C]:
        """A key's transaction for a caller that drives it itself (``scope`` as for
        :meth:`Inbox.transaction`)."""
        return AsyncInboxTransaction(
            self,
            core.validate_idempotency_key(key),
            fingerprint,
            core.check_fence(fence),
            core.check_scope(scope),
        )

    async def process(
        self,
        idempotency_key: str,
        payload: Any,
        effect: Callable[[C], Awaitable[tuple[Any, ...]]],
        *,
        fence: int | None = None,
    ) -> InboxResult:
        """Await ``effect(connection)`` once for the key, or return the answer recorded the first time
        (the async twin of :meth:`Inbox.process`: the same arguments, answers and errors)."""
        if not callable(effect):
            raise errors.InvalidInboxInputError("effect", f"{effect!r:.80} is not callable; pass a function")
        tx = self.transaction(idempotency_key, core.request_fingerprint(payload), fence)
        replay = await tx.begin()
        if replay is not None:
            return replay
        try:
            answer = core.check_answer(tx.key, await effect(tx.connection))
        except BaseException:
            await tx.rollback()
            raise
        return await tx.commit(answer)

    async def purge(self, older_than_ms: int) -> int:
        """Delete completed keys finished more than ``older_than_ms`` ago; return how many."""
        params = {"older_than_ms": core.check_older_than_ms(older_than_ms)}
        session = self._session()
        with translate_errors("purge inbox keys"):
            await session.open()
            try:
                count = await session.count(store.PURGE_DONE, params)
            except BaseException:
                await session.end(commit=False)
                raise
            await session.end(commit=True)
        return count
