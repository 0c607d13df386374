"""Deliver everything in the outbox from a test, waiting out retry backoffs."""

from __future__ import annotations

import time

import sqlalchemy as sa

from dagster_joblease import checks, errors
from dagster_joblease.dispatch.dispatcher import Dispatcher, DispatchReport
from dagster_joblease.storage import outbox as store
from dagster_joblease.storage.engine import translate_errors

__all__ = ["drain_outbox"]

_IDLE_PAUSE_S = 0.02


def _pending(engine: sa.Engine) -> int:
    with translate_errors("count pending outbox rows"), engine.connect() as conn:
        return store.pending_total(conn)


def drain_outbox(dispatcher: Dispatcher, *, timeout_s: float = 30.0, limit: int = 100) -> DispatchReport:
    """Dispatch batches until no outbox row is ``PENDING`` (each is ``SENT`` or ``DEAD``); return the
    summed report.

    Rows waiting out a retry backoff are waited for, so give the dispatcher a short backoff in tests
    (``backoff_base_ms=1, backoff_max_ms=20``). Raises ``AssertionError`` if rows are still pending after
    ``timeout_s``, with their count.
    """
    if not isinstance(dispatcher, Dispatcher):
        raise errors.ConfigurationError(f"dispatcher must be a Dispatcher, got {type(dispatcher).__name__}")
    checks.number("timeout_s", timeout_s, above=0)
    deadline = time.monotonic() + timeout_s
    total = DispatchReport()
    while True:
        report = dispatcher.dispatch(limit)
        total = total.merge(report)
        if report.claimed and time.monotonic() < deadline:
            continue
        pending = _pending(dispatcher.engine)
        if pending == 0:
            return total
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"the outbox still has {pending} PENDING rows after {timeout_s} s of dispatching "
                f"({total.sent} sent, {total.retried} retried, {total.dead} dead so far); is the "
                "downstream failing every attempt, or the backoff longer than the timeout?"
            )
        time.sleep(_IDLE_PAUSE_S)
