"""The library's statements on the caller's own psycopg connection, whatever its settings: pipeline mode,
row factories and cursor factories (storage.driver is the one place that runs them).

Before storage.driver, ``enqueue_many`` read ``cursor.description`` right after ``execute``: in a pipeline
no result has arrived yet, so it inserted again and raised a retryable StorageError while its rows sat in
the caller's transaction (a caller that caught it and committed committed rows it was told were not
written). ``enqueue_once(max_pending=...)`` and ``enqueue_many`` indexed rows by position (``KeyError: 0``
with ``dict_row``), and a ``RawCursor`` connection met ``%s`` placeholders (a syntax error).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import rows as psycopg_rows

from dagster_joblease import errors, outbox
from dagster_joblease.storage.schema import outbox_table


def _conninfo(pg_url: str) -> dict[str, Any]:
    url = sa.make_url(pg_url)
    return {"host": url.host, "port": url.port, "user": url.username, "dbname": url.database}


def _keys(pg_engine: sa.Engine) -> list[str]:
    with pg_engine.connect() as conn:
        return list(
            conn.execute(sa.select(outbox_table.c.idempotency_key).order_by("idempotency_key")).scalars()
        )


def _enqueue_everything(pg: psycopg.Connection[Any]) -> None:
    """Every enqueue on the caller's connection: new rows, repeats, a conflict taken back, the backlog
    bound (its count and its read of an existing row)."""
    assert outbox.enqueue_many(pg, [("v1:a", "t", {"n": 1}), ("v1:b", "t", {"n": 2})]) == (True, True)
    assert outbox.enqueue_many(pg, [("v1:c", "t", {"n": 3}), ("v1:a", "t", {"n": 1})]) == (True, False)
    with pytest.raises(errors.OutboxConflictError):
        # v1:0 sorts first and is inserted, then taken back: the call writes all of its rows or none.
        outbox.enqueue_many(pg, [("v1:0", "t", {"n": 0}), ("v1:b", "t", {"n": 9})])
    assert outbox.enqueue_once(pg, idempotency_key="v1:d", topic="t", payload={"n": 4}, max_pending=10)
    assert not outbox.enqueue_once(pg, idempotency_key="v1:d", topic="t", payload={"n": 4}, max_pending=10)
    with pytest.raises(errors.OutboxBackpressureError):
        outbox.enqueue_once(pg, idempotency_key="v1:e", topic="t", payload={"n": 5}, max_pending=4)
    # At the bound, a repeat of a row already there is still a no-op (the existing-row read).
    assert not outbox.enqueue_once(pg, idempotency_key="v1:a", topic="t", payload={"n": 1}, max_pending=4)
    with pytest.raises(errors.OutboxConflictError):
        outbox.enqueue_once(pg, idempotency_key="v1:a", topic="t", payload={"n": 8})


EXPECTED = ["v1:a", "v1:b", "v1:c", "v1:d"]


def test_enqueue_in_pipeline_mode(pg_engine: sa.Engine, pg_url: str) -> None:
    """psycopg's pipeline mode: the same answers, and exactly the rows the calls said they wrote."""
    with psycopg.connect(**_conninfo(pg_url)) as pg:
        with pg.pipeline():
            _enqueue_everything(pg)
        pg.commit()
    assert _keys(pg_engine) == EXPECTED


def test_a_pipeline_inside_a_transaction_block(pg_engine: sa.Engine, pg_url: str) -> None:
    with psycopg.connect(**_conninfo(pg_url), autocommit=True) as pg:
        with pg.pipeline(), pg.transaction():
            _enqueue_everything(pg)
    assert _keys(pg_engine) == EXPECTED


ROW_FACTORIES: dict[str, Callable[..., Any]] = {
    "dict_row": psycopg_rows.dict_row,
    "namedtuple_row": psycopg_rows.namedtuple_row,
    "kwargs_row": psycopg_rows.kwargs_row(lambda **kw: kw),
    "scalar_row": psycopg_rows.scalar_row,
}


@pytest.mark.parametrize("factory", sorted(ROW_FACTORIES))
def test_any_row_factory(pg_engine: sa.Engine, pg_url: str, factory: str) -> None:
    with psycopg.connect(**_conninfo(pg_url), row_factory=ROW_FACTORIES[factory]) as pg:
        _enqueue_everything(pg)
        pg.commit()
    assert _keys(pg_engine) == EXPECTED


@pytest.mark.parametrize("cursor_factory", [psycopg.RawCursor, psycopg.ClientCursor])
def test_any_cursor_factory(pg_engine: sa.Engine, pg_url: str, cursor_factory: type[Any]) -> None:
    """``RawCursor`` binds ``$1`` and ``ClientCursor`` binds on the client: the library's statements use
    a cursor of their own either way."""
    with psycopg.connect(
        **_conninfo(pg_url), cursor_factory=cursor_factory, row_factory=psycopg_rows.dict_row
    ) as pg:
        _enqueue_everything(pg)
        pg.commit()
    assert _keys(pg_engine) == EXPECTED


def test_threads_sharing_one_connection(pg_engine: sa.Engine, pg_url: str) -> None:
    """The statements kept on a caller's connection are per thread (a psycopg cursor is not thread-safe):
    eight threads enqueuing on one connection at once each get their own answers."""
    answers: list[bool] = []
    failures: list[BaseException] = []

    def enqueue(pg: psycopg.Connection[Any], n: int) -> None:
        try:
            for i in range(40):
                key = f"v1:{n}-{i}"
                answers.append(outbox.enqueue_once(pg, idempotency_key=key, topic="t", payload={"i": i}))
                answers.append(outbox.enqueue_once(pg, idempotency_key=key, topic="t", payload={"i": i}))
        except BaseException as exc:
            failures.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between a cursor's execute and its fetch
    try:
        with psycopg.connect(**_conninfo(pg_url)) as pg:
            threads = [threading.Thread(target=enqueue, args=(pg, n)) for n in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            pg.commit()
    finally:
        sys.setswitchinterval(switch)
    assert failures == []
    assert answers.count(True) == answers.count(False) == 8 * 40
    assert len(_keys(pg_engine)) == 8 * 40


def test_after_an_error_and_a_rollback(pg_engine: sa.Engine, pg_url: str) -> None:
    """A transaction that failed on the caller's own statement, rolled back, then enqueues again on the
    same connection: the kept statements work as before, and the rolled-back row is gone."""
    with psycopg.connect(**_conninfo(pg_url)) as pg:
        assert outbox.enqueue_once(pg, idempotency_key="v1:gone", topic="t", payload={})
        with pytest.raises(psycopg.errors.DivisionByZero):
            pg.execute("SELECT 1 / 0")
        with pytest.raises(errors.StorageError):  # the transaction is aborted: refused, translated
            outbox.enqueue_once(pg, idempotency_key="v1:x", topic="t", payload={})
        pg.rollback()
        assert outbox.enqueue_once(pg, idempotency_key="v1:a", topic="t", payload={})
        assert outbox.enqueue_many(pg, [("v1:a", "t", {}), ("v1:b", "t", {})]) == (False, True)
        pg.commit()
    assert _keys(pg_engine) == ["v1:a", "v1:b"]
