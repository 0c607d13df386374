"""Every way a user can hold a connection either commits the outbox row with the user's transaction or is
refused before anything is written (storage.transaction.callers_transaction is the one rule)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy import orm

from dagster_joblease import errors, outbox
from dagster_joblease.storage import create_engine
from dagster_joblease.storage.schema import outbox_table

_DOMAIN = sa.Table("domain_probe", sa.MetaData(), sa.Column("k", sa.String(40), primary_key=True))


@pytest.fixture
def domain(engine: sa.Engine) -> sa.Engine:
    _DOMAIN.create(engine)
    return engine


def _counts(engine: sa.Engine) -> tuple[int, int]:
    """(domain rows, outbox rows), read on a connection of another engine (what other workers see)."""
    other = create_engine(engine.url, poolclass=sa.pool.NullPool)
    try:
        with other.connect() as conn:
            return (
                conn.execute(sa.select(sa.func.count()).select_from(_DOMAIN)).scalar_one(),
                conn.execute(sa.select(sa.func.count()).select_from(outbox_table)).scalar_one(),
            )
    finally:
        other.dispose()


def _write(conn: sa.Connection | orm.Session, key: str) -> bool:
    conn.execute(_DOMAIN.insert().values(k=key))
    return outbox.enqueue_once(conn, idempotency_key=f"v2:{key}", topic="mail", payload={"v": 1})


def _enqueue_first(conn: sa.Connection | orm.Session, key: str) -> bool:
    """The outbox row first: nothing but the enqueue has begun the transaction."""
    inserted = outbox.enqueue_once(conn, idempotency_key=f"v2:{key}", topic="mail", payload={"v": 1})
    conn.execute(_DOMAIN.insert().values(k=key))
    return inserted


def _enqueue_only(conn: sa.Connection | orm.Session, key: str) -> bool:
    """Only the enqueue: the issue's case (SQLAlchemy never executed anything in this transaction)."""
    return outbox.enqueue_once(conn, idempotency_key=f"v2:{key}", topic="mail", payload={"v": 1})


WRITES = {"domain-first": _write, "outbox-first": _enqueue_first, "outbox-only": _enqueue_only}


def _begin(engine: sa.Engine, write: Callable[[Any, str], bool], key: str) -> bool:
    with engine.begin() as conn:
        return write(conn, key)


def _connect_commit(engine: sa.Engine, write: Callable[[Any, str], bool], key: str) -> bool:
    with engine.connect() as conn:
        inserted = write(conn, key)
        conn.commit()
        return inserted


def _connect_begin_nested(engine: sa.Engine, write: Callable[[Any, str], bool], key: str) -> bool:
    with engine.connect() as conn:
        with conn.begin_nested():
            inserted = write(conn, key)
        conn.commit()
        return inserted


def _session_commit(engine: sa.Engine, write: Callable[[Any, str], bool], key: str) -> bool:
    with orm.Session(engine) as session:
        inserted = write(session, key)
        session.commit()
        return inserted


def _session_begin(engine: sa.Engine, write: Callable[[Any, str], bool], key: str) -> bool:
    with orm.Session(engine) as session, session.begin():
        return write(session, key)


def _scoped_session(engine: sa.Engine, write: Callable[[Any, str], bool], key: str) -> bool:
    registry = orm.scoped_session(orm.sessionmaker(engine))
    try:
        inserted = write(registry, key)
        registry.commit()
        return inserted
    finally:
        registry.remove()


COMMITTING = {
    "begin": _begin,
    "connect-commit": _connect_commit,
    "connect-begin-nested": _connect_begin_nested,
    "session-commit": _session_commit,
    "session-begin": _session_begin,
    "scoped-session": _scoped_session,
}


@pytest.mark.parametrize("order", sorted(WRITES))
@pytest.mark.parametrize("style", sorted(COMMITTING))
def test_each_style_commits_the_row_with_the_domain_change(domain: sa.Engine, style: str, order: str) -> None:
    assert COMMITTING[style](domain, WRITES[order], "k1") is True
    domain_rows = 0 if order == "outbox-only" else 1
    assert _counts(domain) == (domain_rows, 1)
    # A repeat is a no-op in every style, and still commits its domain row.
    assert COMMITTING[style](domain, lambda c, _k: _repeat(c), "") is False
    assert _counts(domain) == (domain_rows + 1, 1)


def _repeat(conn: Any) -> bool:
    conn.execute(_DOMAIN.insert().values(k="k2"))
    return outbox.enqueue_once(conn, idempotency_key="v2:k1", topic="mail", payload={"v": 1})


def test_connect_without_commit_rolls_the_row_back_with_the_domain_change(domain: sa.Engine) -> None:
    with domain.connect() as conn:
        assert outbox.enqueue_once(conn, idempotency_key="v2:gone", topic="mail", payload={"v": 1})
        conn.execute(_DOMAIN.insert().values(k="gone"))
    with domain.connect() as conn:
        assert outbox.enqueue_once(conn, idempotency_key="v2:gone", topic="mail", payload={"v": 1})
        conn.rollback()
    with orm.Session(domain) as session:
        assert outbox.enqueue_once(session, idempotency_key="v2:gone", topic="mail", payload={"v": 1})
        session.rollback()
    assert _counts(domain) == (0, 0)


def test_a_refused_input_after_the_begin_leaves_the_transaction_usable(domain: sa.Engine) -> None:
    with domain.connect() as conn:
        with pytest.raises(errors.InvalidPayloadError, match="payload"):
            outbox.enqueue_once(conn, idempotency_key="v2:bad", topic="mail", payload={"v": float("nan")})
        assert _write(conn, "after")
        conn.commit()
    assert _counts(domain) == (1, 1)


def test_autocommit_sqlalchemy_connections_are_refused_and_write_nothing(engine: sa.Engine) -> None:
    with engine.connect() as plain:
        auto = plain.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(errors.InvalidPayloadError, match="autocommit outside a transaction"):
            outbox.enqueue_once(auto, idempotency_key="v2:auto", topic="mail", payload={"v": 1})
    auto_engine = engine.execution_options(isolation_level="AUTOCOMMIT")
    with auto_engine.connect() as conn, pytest.raises(errors.InvalidPayloadError, match="autocommit"):
        outbox.enqueue_once(conn, idempotency_key="v2:auto", topic="mail", payload={"v": 1})
    with engine.connect() as conn:
        conn.close()
        with pytest.raises(errors.InvalidPayloadError, match="closed"):
            outbox.enqueue_once(conn, idempotency_key="v2:auto", topic="mail", payload={"v": 1})
    with pytest.raises(errors.InvalidPayloadError, match="got Engine"):
        outbox.enqueue_once(engine, idempotency_key="v2:auto", topic="mail", payload={"v": 1})  # type: ignore[arg-type]
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(outbox_table)).scalar_one() == 0


@pytest.fixture
def autocommit_engine(pg_url: str) -> Iterator[sa.Engine]:
    eng = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    yield eng
    eng.dispose()


def test_an_engine_created_in_autocommit_is_refused(
    autocommit_engine: sa.Engine, pg_engine: sa.Engine
) -> None:
    for style in (_begin, _connect_commit):
        with pytest.raises(errors.InvalidPayloadError, match="autocommit outside a transaction"):
            style(
                autocommit_engine,
                lambda c, k: outbox.enqueue_once(c, idempotency_key="v2:a", topic="t", payload={"v": 1}),
                "",
            )
    with pg_engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(outbox_table)).scalar_one() == 0


def test_sqlite_driver_in_autocommit_is_refused(sqlite_url: str) -> None:
    """A plain SQLAlchemy SQLite engine whose sqlite3 connections never begin a transaction."""
    eng = sa.create_engine(sqlite_url)

    @sa.event.listens_for(eng, "connect")
    def _autocommit(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    try:
        with eng.connect() as conn, pytest.raises(errors.InvalidPayloadError, match="autocommit"):
            outbox.enqueue_once(conn, idempotency_key="v2:a", topic="t", payload={"v": 1})
        # The same engine's default pysqlite behaviour (an implicit BEGIN before the INSERT) is accepted.
        plain = sa.create_engine(sqlite_url)
        with plain.connect() as conn:
            assert outbox.enqueue_once(conn, idempotency_key="v2:b", topic="t", payload={"v": 1})
            conn.rollback()
        with plain.connect() as conn:
            assert outbox.enqueue_once(conn, idempotency_key="v2:c", topic="t", payload={"v": 1})
            conn.commit()
        with plain.connect() as conn:
            keys = conn.execute(sa.select(outbox_table.c.idempotency_key)).scalars().all()
        assert keys == ["v2:c"]
        plain.dispose()
    finally:
        eng.dispose()


def test_psycopg_styles(pg_engine: sa.Engine, pg_url: str) -> None:
    url = sa.make_url(pg_url)
    kwargs: dict[str, Any] = {
        "host": url.host,
        "port": url.port,
        "user": url.username,
        "dbname": url.database,
    }
    with psycopg.connect(**kwargs) as pg:  # implicit transaction, committed by the caller
        assert outbox.enqueue_once(pg, idempotency_key="v2:p1", topic="t", payload={"v": 1})
        pg.commit()
    with psycopg.connect(**kwargs, autocommit=True) as pg:
        with pg.transaction():
            assert outbox.enqueue_once(pg, idempotency_key="v2:p2", topic="t", payload={"v": 1})
        with pytest.raises(errors.InvalidPayloadError, match="autocommit outside a transaction"):
            outbox.enqueue_once(pg, idempotency_key="v2:p3", topic="t", payload={"v": 1})
    with pg_engine.connect() as conn:
        keys = conn.execute(sa.select(outbox_table.c.idempotency_key).order_by("id")).scalars().all()
    assert keys == ["v2:p1", "v2:p2"]
