"""The outbox contract on both backends: one row per key, no-op repeats, conflicts, refusals."""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import errors, outbox
from dagster_joblease.storage.clock import db_now_plus_ms
from dagster_joblease.storage.schema import outbox_table
from tests.conftest import wait_until


def _rows(engine: sa.Engine) -> list[Any]:
    t = outbox_table
    with engine.connect() as conn:
        return list(conn.execute(sa.select(t).order_by(t.c.id)))


def _enqueue(
    engine: sa.Engine, key: str = "v2:k1", topic: str = "mail", payload: Any = None, **kw: Any
) -> bool:
    with engine.begin() as conn:
        return outbox.enqueue_once(
            conn,
            idempotency_key=key,
            topic=topic,
            payload={"v": 1, "n": 1} if payload is None else payload,
            **kw,
        )


def test_insert_then_same_payload_is_a_noop(engine: sa.Engine) -> None:
    assert _enqueue(engine, payload={"v": 1, "items": [1, 2], "name": "é"}) is True
    # Same content, other key order: same canonical JSON, same fingerprint, so a no-op.
    assert _enqueue(engine, payload={"name": "é", "items": [1, 2], "v": 1}) is False
    (row,) = _rows(engine)
    assert row.idempotency_key == "v2:k1"
    assert row.topic == "mail"
    assert row.payload == {"v": 1, "items": [1, 2], "name": "é"}
    assert row.payload_sha256 == outbox.payload_fingerprint({"v": 1, "items": [1, 2], "name": "é"})
    assert row.status == outbox.OutboxStatus.PENDING
    assert row.attempts == 0
    assert row.claim_token is None and row.claim_expires_at is None
    assert row.last_error is None and row.last_status is None and row.sent_at is None
    assert row.created_at is not None and row.updated_at is not None and row.next_attempt_at is not None


def test_same_key_different_payload_conflicts_and_keeps_the_original(engine: sa.Engine) -> None:
    assert _enqueue(engine, payload={"v": 1, "amount": 10})
    with pytest.raises(errors.OutboxConflictError) as info:
        _enqueue(engine, payload={"v": 1, "amount": 11})
    assert info.value.idempotency_key == "v2:k1"
    assert info.value.existing_sha256 == outbox.payload_fingerprint({"v": 1, "amount": 10})
    assert "v2:k1" in str(info.value) and "effect_key" in str(info.value)
    (row,) = _rows(engine)
    assert row.payload == {"v": 1, "amount": 10}


def test_rolled_back_enqueue_leaves_no_row(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        tx = conn.begin()
        assert outbox.enqueue_once(conn, idempotency_key="v2:rb", topic="mail", payload={"v": 1})
        tx.rollback()
    assert _rows(engine) == []
    # The key is free again: the domain change and its effect commit (or vanish) together.
    assert _enqueue(engine, key="v2:rb")


def test_enqueue_commits_with_the_domain_change(engine: sa.Engine) -> None:
    domain = sa.Table("domain_change", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    domain.create(engine)
    with pytest.raises(RuntimeError), engine.begin() as conn:
        conn.execute(domain.insert().values(id=1))
        outbox.enqueue_once(conn, idempotency_key="v2:dom", topic="mail", payload={"v": 1})
        raise RuntimeError("the domain transaction fails after enqueueing")
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(domain)).scalar_one() == 0
    assert _rows(engine) == []


_BIG = "x" * (outbox.DEFAULT_MAX_PAYLOAD_BYTES)


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"payload": {"when": object()}}, "payload", "not JSON-serializable"),
        ({"payload": {"ratio": math.nan}}, "payload", "NaN"),
        ({"payload": {"ratio": math.inf}}, "payload", "NaN/Infinity"),
        ({"payload": [-math.inf]}, "payload", "NaN/Infinity"),
        ({"payload": {1, 2}}, "payload", "not JSON-serializable"),
        ({"payload": {"s": "a\x00b"}}, "payload", "NUL"),
        ({"payload": {"s": "\ud800"}}, "payload", "surrogate"),
        ({"payload": {"blob": _BIG}}, "payload", "bytes of canonical JSON"),
        ({"payload": {"s": "é" * 60}, "max_payload_bytes": 100}, "payload", "at most 100"),
        ({"max_payload_bytes": 0}, "max_payload_bytes", "int >= 2"),
        ({"topic": ""}, "topic", "blank"),
        ({"topic": "   "}, "topic", "blank"),
        ({"topic": "t" * 129}, "topic", "at most 128"),
        ({"topic": "a\nb"}, "topic", "U+000A"),
        ({"topic": None}, "topic", "must be a str"),
        ({"key": ""}, "idempotency_key", "blank"),
        ({"key": "k" * 321}, "idempotency_key", "at most 320"),
        ({"key": "v2:\tk"}, "idempotency_key", "U+0009"),
        ({"key": "v2:ключ"}, "idempotency_key", "not ASCII"),
        ({"key": " v2:k"}, "idempotency_key", "whitespace"),
        ({"key": 42}, "idempotency_key", "must be a str"),
    ],
)
def test_refusals_name_field_and_rule_and_write_nothing(
    engine: sa.Engine, kwargs: dict[str, Any], field: str, fragment: str
) -> None:
    with pytest.raises(errors.InvalidPayloadError) as info:
        _enqueue(engine, **kwargs)
    assert info.value.field == field
    assert field in str(info.value)
    assert fragment in str(info.value)
    assert _rows(engine) == []


@pytest.mark.parametrize(
    ("value", "ascii_only", "refusal"),
    [
        ("v2:key", True, None),
        ("bill.daily", False, None),  # exactly the 10 allowed
        ("ключ", False, None),  # a topic or ordering key may be any text
        ("a b", True, None),  # an inner space is no surrounding whitespace
        ("", False, "'' is blank; give a non-empty value"),
        (" \t ", True, "' \\t ' is blank"),
        ("k" * 11, False, "is 11 characters; at most 10 are allowed, shorten it"),
        ("a\x7fb", False, "'a\\x7fb' contains the control character U+007F; remove it"),
        ("a\x85b", True, "contains the control character U+0085"),  # C1, before the ASCII rule
        ("a\ud800", False, "contains the lone surrogate U+D800"),
        ("a\ud800", True, "contains the lone surrogate U+D800"),  # before the ASCII rule
        ("v2:ключ", True, "'v2:ключ' is not ASCII; it travels as the Idempotency-Key HTTP header"),
        (" v2:k", True, "' v2:k' has surrounding whitespace, which HTTP strips from header values; trim it"),
        ("v2:k ", True, "has surrounding whitespace"),
        (" topic", False, None),  # only a header value is trimmed by HTTP
    ],
)
def test_text_refusal_says_the_first_rule_a_key_or_topic_breaks(
    value: str, ascii_only: bool, refusal: str | None
) -> None:
    said = outbox.text_refusal(value, 10, ascii_only=ascii_only)
    assert said == refusal if refusal is None else (said is not None and refusal in said), said


def test_size_limit_is_measured_on_canonical_utf8_bytes(engine: sa.Engine) -> None:
    payload = {"s": "é" * 40}  # 40 characters, 80 bytes of UTF-8
    size = len(outbox.canonical_json(payload).encode("utf-8"))
    assert _enqueue(engine, key="v2:fits", payload=payload, max_payload_bytes=size)
    with pytest.raises(errors.InvalidPayloadError):
        _enqueue(engine, key="v2:over", payload=payload, max_payload_bytes=size - 1)
    assert [r.idempotency_key for r in _rows(engine)] == ["v2:fits"]


def test_canonical_json_and_fingerprint() -> None:
    a = {"b": [1, {"y": 2, "x": 1}], "a": "é", "c": None}
    assert outbox.canonical_json(a) == '{"a":"é","b":[1,{"x":1,"y":2}],"c":null}'
    reordered = json.loads(json.dumps(a, sort_keys=False))
    assert outbox.payload_fingerprint(reordered) == outbox.payload_fingerprint(a)
    assert outbox.payload_fingerprint({"a": 1}) != outbox.payload_fingerprint({"a": 2})
    assert len(outbox.payload_fingerprint(a)) == 64


def test_same_key_same_payload_other_topic_conflicts_and_writes_nothing(engine: sa.Engine) -> None:
    """The key alone is the effect's identity downstream: a second topic under it is a conflict, not a no-op
    (it used to return False and silently drop the second effect)."""
    assert _enqueue(engine, topic="mail", payload={"v": 1, "n": 7})
    with pytest.raises(errors.OutboxConflictError) as info:
        _enqueue(engine, topic="sms", payload={"v": 1, "n": 7})
    assert (info.value.existing_topic, info.value.new_topic) == ("mail", "sms")
    assert info.value.existing_sha256 == info.value.new_sha256
    assert "'mail'" in str(info.value) and "'sms'" in str(info.value)
    (row,) = _rows(engine)
    assert (row.topic, row.payload) == ("mail", {"v": 1, "n": 7})
    assert _enqueue(engine, topic="mail", payload={"v": 1, "n": 7}) is False


def test_due_summary_by_topic_and_retrying(engine: sa.Engine) -> None:
    for key, topic in (("v2:a1", "a"), ("v2:a2", "a"), ("v2:b1", "b"), ("v2:c1", "c")):
        _enqueue(engine, key=key, topic=topic)
    t = outbox_table
    with engine.begin() as conn:
        # a2 failed once and waits out its backoff; b1 failed once and is due again; c1 is in flight.
        conn.execute(
            sa.update(t)
            .where(t.c.idempotency_key == "v2:a2")
            .values(attempts=1, next_attempt_at=db_now_plus_ms(sa.literal(60_000)))
        )
        conn.execute(sa.update(t).where(t.c.idempotency_key == "v2:b1").values(attempts=1))
        conn.execute(
            sa.update(t)
            .where(t.c.idempotency_key == "v2:c1")
            .values(attempts=1, claim_token="x", claim_expires_at=db_now_plus_ms(sa.literal(60_000)))
        )
    everything = outbox.due_summary(engine)
    assert (everything.due, everything.retrying) == (2, 2)  # due: a1, b1; retrying: a2, b1
    a = outbox.due_summary(engine, topics=["a"])
    assert (a.due, a.retrying) == (1, 1) and a.oldest_due_age_ms is not None
    b = outbox.due_summary(engine, topics=("b", "zzz"))
    assert (b.due, b.retrying) == (1, 1)
    assert outbox.due_summary(engine, topics=["c"]) == outbox.DueSummary(0, None, 0)
    assert outbox.due_summary(engine, topics=[]) == outbox.DueSummary(0, None, 0)
    for bad in ("a", 3, [1]):
        with pytest.raises(errors.ConfigurationError, match="topic"):
            outbox.due_summary(engine, topics=bad)  # type: ignore[arg-type]


def test_due_summary_counts_only_claimable_rows(engine: sa.Engine) -> None:
    assert outbox.due_summary(engine) == outbox.DueSummary(due=0, oldest_due_age_ms=None)
    for name in ("due", "later", "claimed", "expired-claim", "sent", "dead"):
        _enqueue(engine, key=f"v2:{name}")
    t = outbox_table
    with engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.idempotency_key == "v2:later")
            .values(next_attempt_at=db_now_plus_ms(sa.literal(60_000)))
        )
        conn.execute(
            sa.update(t)
            .where(t.c.idempotency_key == "v2:claimed")
            .values(claim_token="x", claim_expires_at=db_now_plus_ms(sa.literal(60_000)))
        )
        conn.execute(
            sa.update(t)
            .where(t.c.idempotency_key == "v2:expired-claim")
            .values(claim_token="y", claim_expires_at=db_now_plus_ms(sa.literal(-1_000)))
        )
        conn.execute(sa.update(t).where(t.c.idempotency_key == "v2:sent").values(status="SENT"))
        conn.execute(sa.update(t).where(t.c.idempotency_key == "v2:dead").values(status="DEAD"))
        conn.execute(
            sa.update(t)
            .where(t.c.idempotency_key == "v2:due")
            .values(next_attempt_at=db_now_plus_ms(sa.literal(-5_000)))
        )
    summary = outbox.due_summary(engine)
    assert summary.due == 2  # "due" and "expired-claim"
    assert summary.oldest_due_age_ms is not None and summary.oldest_due_age_ms >= 4_900
    with engine.connect() as conn:
        assert outbox.due_summary(conn).due == 2


def _lock_waiters(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"
                )
            ).scalar_one()
        )


def test_concurrent_enqueue_of_one_key_inserts_once(pg_engine: sa.Engine) -> None:
    """A second writer blocks on the first's uncommitted row, then sees it: no-op or conflict, never two."""
    results: list[object] = []

    def second(payload: dict[str, int]) -> None:
        try:
            results.append(_enqueue(pg_engine, key="v2:race", payload=payload))
        except errors.OutboxConflictError as exc:
            results.append(exc)

    for payload, expected in (({"v": 1}, False), ({"v": 2}, errors.OutboxConflictError)):
        with pg_engine.begin() as conn:
            conn.execute(sa.delete(outbox_table))
        results.clear()
        with pg_engine.begin() as conn:
            assert outbox.enqueue_once(conn, idempotency_key="v2:race", topic="mail", payload={"v": 1})
            thread = threading.Thread(target=second, args=(payload,))
            thread.start()
            wait_until(lambda: _lock_waiters(pg_engine) == 1)
            assert results == []
        thread.join(10)
        (result,) = results
        if expected is False:
            assert result is False
        else:
            assert isinstance(result, errors.OutboxConflictError)
        assert len(_rows(pg_engine)) == 1


def test_driver_errors_surface_as_storage_errors_inside_the_callers_transaction(pg_engine: sa.Engine) -> None:
    """On psycopg the INSERT runs on the caller's driver connection; its errors still become StorageError."""
    with pg_engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE joblease_outbox RENAME TO joblease_outbox_moved")
    with pytest.raises(errors.StorageError, match="enqueue an outbox row"), pg_engine.begin() as conn:
        outbox.enqueue_once(conn, idempotency_key="v2:missing-table", topic="t", payload={"v": 1})
    with pg_engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE joblease_outbox_moved RENAME TO joblease_outbox")
        conn.exec_driver_sql("CREATE TABLE domain_probe (k text PRIMARY KEY)")
    # The caller's transaction is one unit: its domain row and the outbox row commit or vanish together.
    with pytest.raises(RuntimeError), pg_engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO domain_probe VALUES ('a')")
        assert outbox.enqueue_once(conn, idempotency_key="v2:unit", topic="t", payload={"v": 1})
        raise RuntimeError("the domain change failed after the enqueue")
    with pg_engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM domain_probe").scalar_one() == 0
        assert conn.exec_driver_sql("SELECT count(*) FROM joblease_outbox").scalar_one() == 0


def _psycopg_connect(pg_url: str, **kwargs: Any) -> Any:
    import psycopg

    url = sa.make_url(pg_url)
    return psycopg.connect(
        host=url.host, port=url.port, user=url.username, password=url.password, dbname=url.database, **kwargs
    )


def test_enqueue_on_a_plain_psycopg_connection_commits_and_rolls_back_with_it(
    pg_engine: sa.Engine, pg_url: str
) -> None:
    with _psycopg_connect(pg_url) as pg:
        assert outbox.enqueue_once(pg, idempotency_key="v2:pg-1", topic="mail", payload={"v": 1})
        pg.rollback()
        assert _rows(pg_engine) == []
        with pg.transaction():
            assert outbox.enqueue_once(pg, idempotency_key="v2:pg-1", topic="mail", payload={"v": 1})
        assert outbox.enqueue_once(pg, idempotency_key="v2:pg-1", topic="mail", payload={"v": 1}) is False
        with pytest.raises(errors.OutboxConflictError):
            outbox.enqueue_once(pg, idempotency_key="v2:pg-1", topic="mail", payload={"v": 2})
        pg.rollback()
    rows = _rows(pg_engine)
    assert [(r.idempotency_key, r.topic, r.payload, r.status) for r in rows] == [
        ("v2:pg-1", "mail", {"v": 1}, "PENDING")
    ]
    # The same row, whichever connection wrote it: a SQLAlchemy enqueue of it is a no-op.
    assert _enqueue(pg_engine, key="v2:pg-1", payload={"v": 1}) is False


def test_enqueue_refuses_a_psycopg_connection_that_would_commit_the_row_alone(
    pg_engine: sa.Engine, pg_url: str
) -> None:
    with _psycopg_connect(pg_url, autocommit=True) as pg:
        with pytest.raises(errors.InvalidPayloadError, match="autocommit outside a transaction"):
            outbox.enqueue_once(pg, idempotency_key="v2:auto", topic="mail", payload={"v": 1})
        assert _rows(pg_engine) == []
        with pg.transaction():  # inside a transaction block it joins that transaction
            assert outbox.enqueue_once(pg, idempotency_key="v2:auto", topic="mail", payload={"v": 1})
    assert len(_rows(pg_engine)) == 1
    pg.close()
    with pytest.raises(errors.InvalidPayloadError, match="closed"):
        outbox.enqueue_once(pg, idempotency_key="v2:closed", topic="mail", payload={"v": 1})
    with pytest.raises(errors.InvalidPayloadError, match="SQLAlchemy Connection or a psycopg Connection"):
        outbox.enqueue_once(pg_engine, idempotency_key="v2:engine", topic="mail", payload={"v": 1})  # type: ignore[arg-type]
    assert len(_rows(pg_engine)) == 1
