"""enqueue_many on both backends: one outbox row per key in one statement, with enqueue_once's rules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy import event, orm

from dagster_joblease import errors, outbox
from dagster_joblease.outbox import OutboxItem, enqueue_many, enqueue_once
from dagster_joblease.storage import rowset
from dagster_joblease.storage.schema import outbox_table
from tests import test_connection_styles as styles

t = outbox_table


def _rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(t).order_by(t.c.idempotency_key)))


def _items(count: int, topic: str = "billing", version: int = 1) -> list[OutboxItem]:
    return [OutboxItem(f"v2:day-{i:05d}", topic, {"v": version, "day": i}) for i in range(count)]


@pytest.fixture
def statements(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every statement on the outbox table sent through SQLAlchemy or (PostgreSQL) straight on the
    psycopg connection, as enqueue does; observed only, passed through unchanged."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "joblease_outbox" in statement:
            sent.append(statement)

    real_execute = psycopg.Cursor.execute

    def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        if "joblease_outbox" in str(query):
            sent.append(str(query))
        return real_execute(self, query, *args, **kwargs)

    event.listen(engine, "before_cursor_execute", record)
    if engine.dialect.name == "postgresql":
        monkeypatch.setattr(psycopg.Cursor, "execute", execute)
    yield sent
    event.remove(engine, "before_cursor_execute", record)


def test_one_statement_writes_one_row_per_key(engine: sa.Engine, statements: list[str]) -> None:
    items = _items(365)
    with engine.begin() as conn:
        assert enqueue_many(conn, items) == (True,) * 365
    assert len(statements) == 1 and "INSERT INTO joblease_outbox" in statements[0]
    rows = _rows(engine)
    assert [(r.idempotency_key, r.topic, r.payload, r.status, r.attempts) for r in rows] == [
        (i.idempotency_key, "billing", i.payload, "PENDING", 0) for i in items
    ]
    assert [r.payload_sha256 for r in rows] == [outbox.payload_fingerprint(i.payload) for i in items]
    assert all(r.next_attempt_at is not None and r.created_at is not None for r in rows)


def test_rows_are_those_enqueue_once_writes(engine: sa.Engine) -> None:
    """A row written by enqueue_many is a no-op repeat for enqueue_once, and the other way round."""
    with engine.begin() as conn:
        enqueue_once(conn, idempotency_key="v2:day-00001", topic="billing", payload={"v": 1, "day": 1})
        assert enqueue_many(conn, _items(3)) == (True, False, True)
        assert (
            enqueue_once(conn, idempotency_key="v2:day-00002", topic="billing", payload={"day": 2, "v": 1})
            is False
        )
    single, many = (r for r in _rows(engine) if r.idempotency_key in ("v2:day-00001", "v2:day-00000"))
    skip = {
        "id",
        "idempotency_key",
        "payload",
        "payload_sha256",
        "created_at",
        "updated_at",
        "next_attempt_at",
    }
    assert {k: v for k, v in single._asdict().items() if k not in skip} == {
        k: v for k, v in many._asdict().items() if k not in skip
    }


def test_repeats_are_no_ops_and_return_false_per_row(engine: sa.Engine, statements: list[str]) -> None:
    with engine.begin() as conn:
        enqueue_many(conn, _items(4)[1:3])
    statements.clear()
    with engine.begin() as conn:
        # Same payload, keys in another order: same fingerprint (canonical JSON).
        again = [
            OutboxItem(i.idempotency_key, i.topic, dict(reversed(list(i.payload.items())))) for i in _items(4)
        ]
        assert enqueue_many(conn, again) == (True, False, False, True)
    assert len(statements) == 2  # the INSERT, then one read of the rows that were there
    assert len(_rows(engine)) == 4


@pytest.mark.parametrize("change", ["payload", "topic"])
def test_a_conflict_writes_nothing_of_the_call(engine: sa.Engine, change: str) -> None:
    with engine.begin() as conn:
        enqueue_many(conn, _items(5)[2:3])
    before = _rows(engine)
    items = _items(
        5, topic="other" if change == "topic" else "billing", version=2 if change == "payload" else 1
    )
    with engine.begin() as conn:
        with pytest.raises(errors.OutboxConflictError) as caught:
            enqueue_many(conn, items)
        # The caller caught it and commits anyway: still nothing of the refused call is written.
    assert caught.value.idempotency_key == "v2:day-00002"
    if change == "topic":
        assert (caught.value.existing_topic, caught.value.new_topic) == ("billing", "other")
    else:
        assert caught.value.existing_sha256 != caught.value.new_sha256
    assert _rows(engine) == before


def test_rows_roll_back_with_the_callers_transaction(engine: sa.Engine) -> None:
    with pytest.raises(RuntimeError), engine.begin() as conn:
        enqueue_many(conn, _items(10))
        raise RuntimeError("domain change failed")
    assert _rows(engine) == []


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([], "rows: is empty"),
        ("v2:x", "must be a list"),
        ({"v2:x": 1}, "must be a list"),
        ([("v2:a", "t")], "row 0: must be an OutboxItem"),
        ([OutboxItem("v2:a", "t", 1), OutboxItem("v2:a", "t", 1)], "row 1: repeats the idempotency key"),
        (
            [OutboxItem("v2:a", "t", 1), OutboxItem("v2:é", "t", 1)],
            r"idempotency_key of row 1 \(key 'v2:é'\)",
        ),
        ([OutboxItem("v2:a", " ", 1)], "topic of row 0"),
        ([OutboxItem("v2:a", "t", float("nan"))], "payload of row 0"),
        ([OutboxItem("v2:a", "t", "x" * 300_000)], "payload of row 0 .* at most 262144"),
    ],
)
def test_bad_rows_are_refused_before_any_sql(
    engine: sa.Engine, statements: list[str], rows: Any, match: str
) -> None:
    with engine.begin() as conn:
        with pytest.raises(errors.InvalidPayloadError, match=match):
            enqueue_many(conn, rows)
        with pytest.raises(errors.InvalidPayloadError, match="max_payload_bytes"):
            enqueue_many(conn, _items(1), max_payload_bytes=1)
    assert statements == [] and _rows(engine) == []


def test_too_many_rows_are_refused_with_the_bound(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rowset, "MAX_ROWS", 3)
    with engine.begin() as conn, pytest.raises(errors.InvalidPayloadError, match="more than 3 rows"):
        enqueue_many(conn, _items(4))
    assert _rows(engine) == []


def test_large_sets_are_written_in_chunks_in_one_call(
    engine: sa.Engine, statements: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with engine.begin() as conn:
        assert enqueue_many(conn, _items(10_000)) == (True,) * 10_000
    assert len(statements) == 1
    monkeypatch.setattr(rowset, "ROWS_PER_STATEMENT", 4_000)
    with engine.begin() as conn:
        assert sum(enqueue_many(conn, _items(12_000))) == 2_000
    assert len(_rows(engine)) == 12_000


# -- connection styles: enqueue_many refuses or joins exactly as enqueue_once does ---------------------


def _psycopg_connect(pg_url: str, **kwargs: Any) -> psycopg.Connection[Any]:
    url = sa.make_url(pg_url)
    return psycopg.connect(
        host=url.host, port=url.port, user=url.username, password=url.password, dbname=url.database, **kwargs
    )


def test_a_plain_psycopg_connection_commits_and_rolls_back_with_it(pg_engine: sa.Engine, pg_url: str) -> None:
    with _psycopg_connect(pg_url) as pg:
        assert enqueue_many(pg, _items(3)) == (True,) * 3
        pg.rollback()
        assert _rows(pg_engine) == []
        with pg.transaction():
            assert enqueue_many(pg, _items(3)) == (True,) * 3
        assert enqueue_many(pg, _items(4)) == (False, False, False, True)
        with pytest.raises(errors.OutboxConflictError):
            enqueue_many(pg, _items(4, version=2))
        pg.rollback()
    assert len(_rows(pg_engine)) == 3


def test_a_psycopg_connection_that_would_commit_alone_is_refused(pg_engine: sa.Engine, pg_url: str) -> None:
    with _psycopg_connect(pg_url, autocommit=True) as pg:
        with pytest.raises(errors.InvalidPayloadError, match="autocommit outside a transaction"):
            enqueue_many(pg, _items(2))
        assert _rows(pg_engine) == []
        with pg.transaction():
            assert enqueue_many(pg, _items(2)) == (True, True)
    pg.close()
    with pytest.raises(errors.InvalidPayloadError, match="closed"):
        enqueue_many(pg, _items(1))
    with pytest.raises(errors.InvalidPayloadError, match="SQLAlchemy Connection or a psycopg Connection"):
        enqueue_many(pg_engine, _items(1))  # type: ignore[arg-type]
    assert len(_rows(pg_engine)) == 2


def test_a_conflict_on_psycopg_takes_back_the_calls_rows(pg_engine: sa.Engine, pg_url: str) -> None:
    with pg_engine.begin() as conn:
        enqueue_many(conn, _items(3)[1:2])
    with _psycopg_connect(pg_url) as pg:
        with pg.transaction():
            with pytest.raises(errors.OutboxConflictError):
                enqueue_many(pg, _items(3, topic="other"))
    assert [r.idempotency_key for r in _rows(pg_engine)] == ["v2:day-00001"]


# Every style test_connection_styles checks for enqueue_once, with enqueue_many in its place.


@pytest.fixture
def domain(engine: sa.Engine) -> sa.Engine:
    styles._DOMAIN.create(engine)
    return engine


def _many_after_domain(conn: Any, key: str) -> bool:
    conn.execute(styles._DOMAIN.insert().values(k=key))
    return all(
        enqueue_many(conn, [OutboxItem(f"v2:{key}", "mail", {"v": 1}), OutboxItem(f"v2:{key}-b", "mail", 2)])
    )


def _many_only(conn: Any, key: str) -> bool:
    return all(
        enqueue_many(conn, [OutboxItem(f"v2:{key}", "mail", {"v": 1}), OutboxItem(f"v2:{key}-b", "mail", 2)])
    )


@pytest.mark.parametrize("style", sorted(styles.COMMITTING))
def test_each_connection_style_commits_the_rows_with_the_domain_change(domain: sa.Engine, style: str) -> None:
    assert styles.COMMITTING[style](domain, _many_after_domain, "k1") is True
    assert styles._counts(domain) == (1, 2)
    assert styles.COMMITTING[style](domain, _many_only, "k2") is True
    assert styles._counts(domain) == (1, 4)


def test_a_connection_closed_without_commit_rolls_the_rows_back(domain: sa.Engine) -> None:
    with domain.connect() as conn:
        assert _many_after_domain(conn, "gone")
    with orm.Session(domain) as session:
        assert _many_only(session, "gone")
        session.rollback()
    assert styles._counts(domain) == (0, 0)


def test_autocommit_sqlalchemy_connections_are_refused(engine: sa.Engine) -> None:
    with engine.connect() as plain:
        auto = plain.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(errors.InvalidPayloadError, match="autocommit outside a transaction"):
            enqueue_many(auto, _items(2))
    assert _rows(engine) == []
