"""The inbox on a SQLAlchemy engine (PostgreSQL or SQLite): for WSGI apps, workers and plain code.

Processing a key is **one transaction**: look the key up, run the effect on the same connection, record the
key as ``DONE`` with the effect's answer. The effect, the stored answer and ``DONE`` commit together or not
at all, so a consumer that crashes at any point leaves the key new again (never applied but unrecorded),
and a retry can process it at once.

On PostgreSQL the transaction first takes a transaction-scoped advisory lock on the key without waiting, so
a concurrent duplicate is told the key is in flight (HTTP 409) instead of queueing behind the effect. The
lock ends with the transaction: when the consumer commits, rolls back, or loses its session (killed, or idle
inside its effect for longer than ``lock_ms``, the transaction's ``idle_in_transaction_session_timeout``).
If another transaction recorded the key first (it committed between this one's lookup and its record), the
record inserts nothing, this transaction and its effect roll back, and the first one's answer is replayed.

On SQLite, writers are serialized (``BEGIN IMMEDIATE``), so a second caller for a key being processed waits
for the effect to commit and then gets the replay instead of 409.

This follows the IETF ``Idempotency-Key`` draft (400 missing key, 409 in flight, 422 same key with another
payload, replay of the first answer) and Brandur Leach's Stripe-like design.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from typing import Any

import sqlalchemy as sa

from dagster_joblease import errors
from dagster_joblease.inbox import core
from dagster_joblease.inbox.core import Answer, InboxResult, VerdictKind
from dagster_joblease.storage import driver
from dagster_joblease.storage import inbox as store
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.transaction import callers_transaction

__all__ = ["Effect", "Inbox", "InboxTransaction"]

logger = logging.getLogger(__name__)

#: An effect runs inside the inbox's transaction and returns the answer to record:
#: ``(status, body)`` or ``(status, body, headers)``, the body ``str`` or ``bytes``.
Effect = Callable[[sa.Connection], tuple[Any, ...]]


def _drive(db: driver.Statements, steps: Generator[core.Batch, Any, Any]) -> Any:
    """Run a sans-IO statement sequence (each batch's statements one after another); its return value."""
    try:
        batch = next(steps)
        while True:
            batch = steps.send(
                tuple(db.first(q, p) if q.returns_rows else db.rowcount(q, p) for q, p in batch)
            )
    except StopIteration as done:
        return done.value


class InboxTransaction:
    """One key's transaction, in three calls: :meth:`begin`, then :meth:`commit` or :meth:`rollback`.

    :meth:`begin` returns the stored answer (a replay), raises a refusal, or returns None with the
    transaction open: write the effect on :attr:`connection`, then :meth:`commit` its answer. This is what
    :meth:`Inbox.process` and the ASGI middleware do; use it where the effect is not one function call.
    """

    def __init__(
        self, inbox: Inbox, key: str, fingerprint: str, fence: int | None, scope: str | None = None
    ) -> None:
        self.inbox = inbox
        self.key = key
        self.fingerprint = fingerprint
        self.fence = fence
        self.scope = scope
        #: What the key's record is stored (and locked) under: the key, or its caller's scope and key.
        self.record_key = core.record_key(key, scope)
        self._conn: sa.Connection | None = None
        self._db: driver.Statements | None = None

    @property
    def connection(self) -> sa.Connection:
        """The transaction's connection: write the effect here so it commits with the stored answer."""
        if self._conn is None:
            raise errors.ConfigurationError("the inbox transaction is not open: begin() returned an answer")
        return self._conn

    def begin(self) -> InboxResult | None:
        """Open the transaction and judge the key: the replay, None (apply the effect), or a refusal.

        Raises:
            InboxInProgressError: another transaction holds the key (HTTP 409).
            InboxConflictError: the key was used with another request (HTTP 422).
            InboxStaleFenceError: a lower fencing number than one already accepted (HTTP 409).
            StorageError: the database failed.
        """
        inbox = self.inbox
        with translate_errors("process an inbox key"):
            # Inside the translation: a database that is down, or a pool that timed out, is a
            # StorageError (503 under the middleware), as it is for the AsyncInbox.
            conn = inbox.engine.connect()
        try:
            with translate_errors("process an inbox key"):
                conn.begin()
                db = driver.in_transaction(callers_transaction(conn))
                verdict, row = _drive(
                    db,
                    core.begin_steps(
                        inbox.dialect_name, self.record_key, self.fingerprint, self.fence, inbox.lock_ms
                    ),
                )
                if verdict.kind in (VerdictKind.APPLY, VerdictKind.APPLY_AFTER_EXPIRY):
                    self._conn, self._db = conn, db
                    return None
                conn.commit()  # a read (and maybe a newer fencing number): nothing to undo
        finally:
            if self._conn is None:
                conn.close()
        core.raise_refusal(self.key, self.fence, verdict)
        return core.stored_result(row)

    def commit(self, answer: Answer) -> InboxResult:
        """Record ``answer`` under the key and commit it with the effect; the answer as recorded.

        If another transaction recorded the key first, this one (and its effect) rolls back and that
        transaction's answer is returned as a replay (or its refusal raised).
        """
        conn, db = self.connection, self._db
        assert db is not None
        params = core.record_params(self.record_key, self.fingerprint, self.fence, answer)
        try:
            with translate_errors("record an inbox result"):
                recorded = db.first(store.RECORD_DONE, params)
                if recorded is not None:
                    conn.commit()
        except BaseException:
            self.rollback()
            raise
        if recorded is None:
            self.rollback()
            return self._look_again()
        self._close()
        logger.debug("inbox key %r processed (status %d)", self.key, answer.status_code)
        return InboxResult(answer.status_code, answer.body, False, answer.headers)

    def rollback(self) -> None:
        """Roll the transaction and the effect back: the key stays new."""
        conn = self._conn
        if conn is None:
            return
        try:
            conn.rollback()
        except sa.exc.DBAPIError:
            # The session is gone (the server ended an idle transaction, a restart): nothing is left to
            # roll back; the connection is discarded, never returned to the pool.
            conn.invalidate()
        finally:
            self._close()

    def _close(self) -> None:
        conn, self._conn, self._db = self._conn, None, None
        if conn is not None:
            conn.close()

    def _look_again(self) -> InboxResult:
        again = InboxTransaction(self.inbox, self.key, self.fingerprint, self.fence, self.scope)
        replay = again.begin()
        if replay is None:  # recorded and gone again (purged) meanwhile: let the sender retry
            again.rollback()
            raise errors.InboxInProgressError(idempotency_key=self.key)
        return replay


class Inbox:
    """Deduplicate incoming requests by idempotency key on a migrated engine (PostgreSQL or SQLite).

    Args:
        engine: an engine over a database migrated with :func:`dagster_joblease.migrate`.
        lock_ms: the longest an effect may sit idle inside its transaction. On PostgreSQL a consumer
            stuck longer than this in its effect loses its database session, so its effect rolls back
            and the key is free again; a key in flight answers 409 meanwhile. Make it comfortably longer
            than the slowest effect.

    Example::

        inbox = Inbox(engine)

        def apply(conn: sa.Connection) -> tuple[int, str]:
            conn.execute(orders.insert().values(...))
            return 201, '{"created": true}'

        result = inbox.process(request.headers["Idempotency-Key"], request.body, apply)
    """

    def __init__(self, engine: sa.Engine, *, lock_ms: int = core.DEFAULT_LOCK_MS) -> None:
        self.engine = engine
        self.lock_ms = core.check_lock_ms(lock_ms)
        self.dialect_name = engine.dialect.name

    def transaction(
        self, key: str, fingerprint: str, fence: int | None = None, *, scope: str | None = None
    ) -> InboxTransaction:
        """A key's transaction for a caller that drives it itself (see :class:`InboxTransaction`).

        ``scope`` makes the key its caller's (an account, a tenant): the same key under two scopes is two
        records, neither able to read nor block the other. None: one namespace for every caller.
        """
        return InboxTransaction(
            self,
            core.validate_idempotency_key(key),
            fingerprint,
            core.check_fence(fence),
            core.check_scope(scope),
        )

    def process(
        self, idempotency_key: str, payload: Any, effect: Effect, *, fence: int | None = None
    ) -> InboxResult:
        """Run ``effect`` once for ``idempotency_key``, or return the answer recorded the first time.

        ``effect(connection)`` runs inside the transaction that records the key as done and returns
        ``(status_code, body)`` or ``(status_code, body, headers)``; write the effect's rows on that
        connection so they commit (or roll back) together with the record. ``payload`` is fingerprinted
        (:func:`request_fingerprint`): the same key with another payload is a conflict. ``fence`` is the
        request's fencing number, if it sent one: a lower one than already accepted for the key is refused.

        Raises:
            InvalidInboxInputError: a bad key or fence (before any SQL) or a malformed effect result.
            InboxConflictError: the key was already used with a different payload (HTTP 422).
            InboxInProgressError: another consumer is processing the key right now (HTTP 409); retry later.
            InboxStaleFenceError: the fencing number is older than one already accepted (HTTP 409).

        If ``effect`` raises, its transaction rolls back and the exception propagates: the key can be
        retried at once. Failures are not stored as the key's answer (as the IETF draft permits), because
        a failed effect did not happen; an effect that wants a rejection to be final returns a 4xx.
        """
        if not callable(effect):
            raise errors.InvalidInboxInputError("effect", f"{effect!r:.80} is not callable; pass a function")
        tx = self.transaction(idempotency_key, core.request_fingerprint(payload), fence)
        replay = tx.begin()
        if replay is not None:
            return replay
        try:
            answer = core.check_answer(tx.key, effect(tx.connection))
        except BaseException:
            tx.rollback()
            raise
        return tx.commit(answer)

    def purge(self, older_than_ms: int) -> int:
        """Delete completed keys finished more than ``older_than_ms`` ago (database clock); return how many.

        A purged key is new again: a replay after purging runs the effect a second time. Keep
        ``older_than_ms`` longer than the longest time a producer may retry (a route's ``dedupe_window``).
        """
        params = {"older_than_ms": core.check_older_than_ms(older_than_ms)}
        with translate_errors("purge inbox keys"), self.engine.begin() as conn:
            return driver.sqlalchemy_statements(conn).rowcount(store.PURGE_DONE, params)
