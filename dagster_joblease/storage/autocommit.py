"""Autocommit psycopg connections kept beside an engine's pool, for one-statement hot paths.

A lease claim is one statement (two when it meets an existing row), a receiver POST one function call.
Checked out of SQLAlchemy's pool each would also pay the checkout and checkin events, the reset-on-return
and two autocommit switches: more client CPU than the driver and the statement together. These
connections are made like the engine's (same URL, connect arguments and connect events), detached at
once from a pool of their own, switched to autocommit once and reused, one caller at a time.

Bounds and lifetime: at most ``pool.size()`` of them sit idle per engine (no limit for ``pool_size=0``,
as for the pool; none for an engine without a sized pool, e.g. ``NullPool``: each claim then opens and
closes its own); ``engine.dispose()`` closes
the idle ones and any in use when they come back; a connection idle for ``IDLE_PING_AFTER_S`` is pinged
before reuse; a broken one is closed, and so are its idle siblings (the server probably restarted).
A forked child never reuses (or closes) its parent's connections.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.pq import TransactionStatus
from sqlalchemy import event

from dagster_joblease.storage import engine as engine_module

__all__ = ["AutocommitConnection", "AutocommitConnections", "autocommit_connections"]

_IDLE = TransactionStatus.IDLE


class AutocommitConnection:
    """One driver connection in autocommit, reused one caller at a time.

    ``statements``: the store modules' statements on it (:mod:`dagster_joblease.storage.driver` keeps
    its cursors there, one per statement). ``cursor``: a plain cursor for the idle ping and for a
    caller's own SQL (the dispatcher's pause refresh).
    """

    __slots__ = ("connection", "cursor", "generation", "statements")

    def __init__(self, connection: psycopg.Connection[Any], generation: int) -> None:
        self.connection = connection
        self.cursor = connection.cursor()
        self.generation = generation
        self.statements: Any = None


class AutocommitConnections:
    """Idle autocommit driver connections of one engine (thread-safe; each connection used by one
    caller at a time)."""

    def __init__(self, max_idle: int) -> None:
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[tuple[AutocommitConnection, float]] = []
        self._generation = 0
        self._pid = os.getpid()

    def acquire(self, engine: sa.Engine) -> AutocommitConnection:
        """An idle connection, or a new one from ``engine``; hand it back with :meth:`release`."""
        if self._pid != os.getpid():
            self._forget_after_fork()
        while True:
            with self._lock:
                if not self._idle:
                    break
                handle, since = self._idle.pop()
            if handle.connection.closed:
                continue
            if time.monotonic() - since < engine_module.IDLE_PING_AFTER_S:
                return handle
            try:
                handle.cursor.execute("SELECT 1")
            except psycopg.Error:
                handle.connection.close()
                continue
            return handle
        generation = self._generation
        proxied = _factory(engine).connect()
        conn: psycopg.Connection[Any] = proxied.driver_connection  # type: ignore[assignment]
        proxied.detach()
        try:
            conn.autocommit = True
        except BaseException:
            conn.close()
            raise
        return AutocommitConnection(conn, generation)

    @contextlib.contextmanager
    def connection(self, engine: sa.Engine) -> Iterator[AutocommitConnection]:
        """An autocommit connection for the block; one that saw an error there is closed, not reused."""
        handle = self.acquire(engine)
        try:
            yield handle
        except BaseException:
            self.release(handle, discard=True)
            raise
        self.release(handle)

    def release(self, handle: AutocommitConnection, *, discard: bool = False) -> None:
        """Keep the connection for reuse if it is healthy and idle; close it otherwise.

        ``discard``: the caller saw an error on it. It is closed rather than trusted again (a server
        that forgot a prepared statement, behind a pooler, fails every later call on that session).
        A connection interrupted mid-statement (its status not IDLE) is never reused either. A broken
        one also closes the idle ones: whatever broke it (a restart, a failover) broke them too.
        """
        conn = handle.connection
        if self._pid != os.getpid():
            return  # fork during the call: the socket is the parent's (see _forget_after_fork)
        if conn.closed or conn.broken:
            conn.close()
            self.close_idle()
            return
        if discard or conn.pgconn.transaction_status != _IDLE or handle.generation != self._generation:
            conn.close()
            return
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append((handle, time.monotonic()))
                return
        conn.close()

    def close_idle(self) -> None:
        """Close the idle connections; those in use are closed when they come back."""
        if self._pid != os.getpid():
            self._forget_after_fork()
            return
        with self._lock:
            idle, self._idle = self._idle, []
            self._generation += 1
        for handle, _ in idle:
            handle.connection.close()

    def _forget_after_fork(self) -> None:
        # The parent's sockets are shared with this process: never use them, never close them (psycopg
        # does not terminate a connection it finds garbage-collected in another process).
        self._lock = threading.Lock()
        self._idle = []
        self._generation += 1
        self._pid = os.getpid()


_FACTORY = "_joblease_claim_connection_factory"


def _factory(engine: sa.Engine) -> sa.pool.Pool:
    """A pool of our own (same creator and connect events as the engine's) that only ever makes new
    connections, detached at once: the engine's own pool is left to SQLAlchemy's users.

    It is kept on the engine itself, not here: a copied pool carries SQLAlchemy's own first-connect
    listener, which refers to the engine, so a registry value holding it would keep its key (the engine)
    alive forever. On the engine it is only a cycle, freed with the engine. One per process.
    """
    pid = os.getpid()
    found: tuple[int, sa.pool.Pool] | None = engine.__dict__.get(_FACTORY)
    if found is None or found[0] != pid:
        engine_module.ready_dialect(engine)  # its raw connections never run the engine's engine_connect
        found = engine.__dict__[_FACTORY] = (pid, engine.pool.recreate())
    return found[1]


_by_engine: weakref.WeakKeyDictionary[sa.Engine, AutocommitConnections] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A fork can happen while another thread holds a lock here (a first claim on a new engine): the
    child, which has only the forking thread, would wait for it forever. Fresh locks, no parent sockets."""
    global _registry_lock
    _registry_lock = threading.Lock()
    for connections in list(_by_engine.values()):
        connections._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def autocommit_connections(engine: sa.Engine) -> AutocommitConnections:
    """The autocommit connections of ``engine`` (created on first use; PostgreSQL with psycopg only)."""
    found = _by_engine.get(engine)
    if found is not None:
        return found
    with _registry_lock:
        found = _by_engine.get(engine)
        if found is None:
            pool = engine.pool
            size = 0  # NullPool and other unsized pools: keep none
            if isinstance(pool, sa.pool.QueuePool):
                # pool_size=0 is SQLAlchemy's "no limit": keep as many as are used.
                size = pool.size() if pool.size() > 0 else sys.maxsize
            connections = AutocommitConnections(max_idle=size)
            # Neither the listener nor the finalizer reaches the engine: the value must not keep its key.
            event.listen(engine, "engine_disposed", lambda _engine: connections.close_idle())
            weakref.finalize(engine, connections.close_idle)
            engine_module.fork_safe(engine)
            found = _by_engine[engine] = connections
    return found
