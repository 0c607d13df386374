"""``RecordingDownstream``: the reference receiver in-process, counting POSTs and effects per key."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import sqlalchemy as sa

from dagster_joblease import errors, inbox
from dagster_joblease.receiver.app import effect_table, ensure_tables, request_table
from dagster_joblease.receiver.server import ReceiverOptions, ReceiverServer
from dagster_joblease.storage.engine import create_engine, translate_errors
from dagster_joblease.storage.migrate import migrate

__all__ = ["RecordingDownstream"]


class RecordingDownstream:
    """The reference receiver on ``127.0.0.1`` and a free port, its inbox in a throwaway database.

    It applies each ``Idempotency-Key`` once (the inbox) and records every POST, so a test can check
    what a real deduplicating downstream saw: :meth:`posts` and :meth:`effects` per key, :meth:`keys`,
    and :meth:`assert_each_effect_once`. Faults for the next N POSTs (counted from the call):
    :meth:`fail_next`, :meth:`drop_after_apply_next`, :meth:`slow_next`.

    Args:
        database: a URL for the receiver's inbox and logs; default an SQLite file in a temporary
            directory, deleted on close. A given database is migrated and kept.
        lock_ms: the inbox's claim lock (how long a request that died mid-effect keeps its key busy).

    Example::

        with RecordingDownstream() as downstream:
            routes = {"billing": Route(downstream.url("/billing"))}
            ...  # enqueue, then deliver with a Dispatcher over those routes
            downstream.assert_each_effect_once()
    """

    def __init__(self, database: str | None = None, *, lock_ms: int = inbox.DEFAULT_LOCK_MS) -> None:
        if database is not None and not isinstance(database, str):
            raise errors.ConfigurationError(
                f"database must be a database URL (str) or None for a throwaway SQLite file, got "
                f"{type(database).__name__}"
            )
        self._database = database
        self._lock_ms = lock_ms
        self._folder: Path | None = None
        self._engine: sa.Engine | None = None
        self._server: ReceiverServer | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> RecordingDownstream:
        """Create the database and start serving (``with RecordingDownstream() as d`` does this)."""
        if self._server is not None:
            return self
        url = self._database
        if url is None:
            self._folder = Path(tempfile.mkdtemp(prefix="joblease-downstream-"))
            url = f"sqlite:///{self._folder / 'downstream.sqlite'}"
        try:
            self._engine = create_engine(url)
            migrate(self._engine)
            ensure_tables(self._engine)
            server = ReceiverServer(self._engine, options=ReceiverOptions(lock_ms=self._lock_ms), proxy=True)
            self._server = server.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop serving and delete the throwaway database (a request still in flight gets 2 s)."""
        if self._server is not None:
            self._server.close()
        if self._engine is not None:
            self._engine.dispose()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        self._server = self._engine = self._folder = None

    def __enter__(self) -> RecordingDownstream:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def server(self) -> ReceiverServer:
        """The running :class:`ReceiverServer` (for what this class does not wrap)."""
        if self._server is None:
            raise errors.ConfigurationError(
                "the RecordingDownstream is not running; use `with RecordingDownstream() as downstream:` "
                "or call start()"
            )
        return self._server

    @property
    def engine(self) -> sa.Engine:
        """The engine of the receiver's own database (inbox, effects, request log)."""
        self.server  # noqa: B018 - raises the "not running" error
        assert self._engine is not None
        return self._engine

    # -- addresses ---------------------------------------------------------------------------------

    def url(self, path: str = "/") -> str:
        """The URL of a route on this downstream; the path (without its leading ``/``) is the topic."""
        if not isinstance(path, str) or any(ch in path for ch in "?#\r\n "):
            raise errors.ConfigurationError(
                f"path {path!r} must be a plain URL path like '/billing' (no query, fragment or spaces)"
            )
        return self.server.url + "/" + path.lstrip("/")

    # -- what it saw -------------------------------------------------------------------------------

    def _flush(self) -> None:
        self.server.flush_log()

    def posts(self, key: str) -> int:
        """How many POSTs carried ``key`` (faulted, replayed and rejected ones included)."""
        self._flush()
        return self._count(request_table, request_table.c.idempotency_key == key)

    def effects(self, key: str) -> int:
        """How many times the effect for ``key`` was applied (the inbox makes it 0 or 1)."""
        return self._count(effect_table, effect_table.c.idempotency_key == key)

    def _count(self, table: sa.Table, where: sa.ColumnElement[bool]) -> int:
        stmt = sa.select(sa.func.count()).select_from(table).where(where)
        with translate_errors("count what the downstream saw"), self.engine.connect() as conn:
            return int(conn.execute(stmt).scalar_one())

    def keys(self) -> list[str]:
        """Every idempotency key POSTed, applied or not, in the order first seen."""
        self._flush()
        t = request_table
        stmt = (
            sa.select(t.c.idempotency_key)
            .where(t.c.idempotency_key.is_not(None))
            .group_by(t.c.idempotency_key)
            .order_by(sa.func.min(t.c.id))
        )
        with translate_errors("list the downstream's keys"), self.engine.connect() as conn:
            return [str(key) for key in conn.execute(stmt).scalars()]

    def assert_each_effect_once(self, keys: Iterable[str] | None = None) -> None:
        """Raise ``AssertionError`` naming every key whose effect was applied 0 or more than 1 times.

        ``keys`` defaults to every key POSTed (:meth:`keys`); pass the keys you expect to have been
        delivered to also catch one that never arrived. The receiver applies each key at most once, so
        a sender that repeats an effect *under a new key* (one derived from the attempt or the owner
        token) shows up as extra keys, not as a second effect: compare :meth:`keys` with the keys you
        expect as well.
        """
        if isinstance(keys, str):
            raise errors.ConfigurationError(
                f"keys={keys!r} must be an iterable of keys, not one str; wrap it in a list"
            )
        wanted = self.keys() if keys is None else list(keys)
        t = effect_table
        stmt = sa.select(t.c.idempotency_key, sa.func.count()).group_by(t.c.idempotency_key)
        with translate_errors("count the downstream's effects"), self.engine.connect() as conn:
            applied = {str(key): int(n) for key, n in conn.execute(stmt)}
        wrong = {key: applied.get(key, 0) for key in wanted if applied.get(key, 0) != 1}
        if wrong:
            posts = {key: self.posts(key) for key in wrong}
            lines = [f"  {key}: {n} effects, {posts[key]} POSTs" for key, n in wrong.items()]
            raise AssertionError(
                f"{len(wrong)} of {len(wanted)} keys did not have exactly one effect:\n" + "\n".join(lines)
            )

    # -- faults ------------------------------------------------------------------------------------

    def fail_next(self, n: int, status: int = 500) -> None:
        """Answer the next ``n`` POSTs with ``status``, applying nothing (a downstream outage)."""
        self.server.inject_next(n, "fail", status=status)

    def drop_after_apply_next(self, n: int) -> None:
        """Apply the next ``n`` POSTs' effects, then drop each connection before answering.

        The sender cannot tell this from a lost request, so it retries; the effect must not repeat.
        """
        self.server.inject_next(n, "drop_after_apply")

    def slow_next(self, n: int, seconds: float) -> None:
        """Apply the next ``n`` POSTs' effects, then answer ``seconds`` late (past a client timeout)."""
        self.server.inject_next(n, "slow", seconds=seconds)
