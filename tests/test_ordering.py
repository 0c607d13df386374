"""Per-key ordering, the enqueue side: the ordering key is stored, validated and (PostgreSQL) locked so that
a key's ids are in commit order; ``enqueue_many`` keeps the list's order within a key."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import errors, outbox
from dagster_joblease.storage import outbox as store
from dagster_joblease.storage.schema import outbox_table
from tests.conftest import wait_until


def _keys_by_id(engine: sa.Engine) -> list[tuple[str, str | None]]:
    t = outbox_table
    with engine.connect() as conn:
        return [
            (r[0], r[1])
            for r in conn.execute(sa.select(t.c.idempotency_key, t.c.ordering_key).order_by(t.c.id))
        ]


def _enqueue(engine: sa.Engine, key: str, ordering_key: Any, payload: Any = None) -> bool:
    with engine.begin() as conn:
        return outbox.enqueue_once(
            conn, idempotency_key=key, topic="t", payload=payload or {"k": key}, ordering_key=ordering_key
        )


def test_enqueue_once_stores_the_ordering_key_and_a_repeat_is_a_noop(engine: sa.Engine) -> None:
    assert _enqueue(engine, "a", "customer-42") is True
    assert _enqueue(engine, "a", "customer-42") is False
    assert _enqueue(engine, "b", None) is True
    assert _keys_by_id(engine) == [("a", "customer-42"), ("b", None)]


def test_a_repeat_under_another_ordering_key_conflicts(engine: sa.Engine) -> None:
    assert _enqueue(engine, "a", "customer-42")
    for other in ("customer-43", None):
        with pytest.raises(errors.OutboxConflictError, match="ordering key 'customer-42', not") as info:
            _enqueue(engine, "a", other)
        assert (info.value.existing_ordering_key, info.value.new_ordering_key) == ("customer-42", other)
    with pytest.raises(errors.OutboxConflictError, match="ordering key 'customer-42'"):
        with engine.begin() as conn:
            outbox.enqueue_many(conn, [outbox.OutboxItem("a", "t", {"k": "a"}, "customer-7")])
    assert _keys_by_id(engine) == [("a", "customer-42")]


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ("", "is blank"),
        ("   ", "is blank"),
        (" customer-42", "surrounding whitespace"),
        ("customer-42\n", "control character U+000A"),
        ("cust\x00omer", "control character U+0000"),
        ("x" * 129, "is 129 characters; at most 128"),
        (42, "must be a str, got int"),
        (b"customer-42", "must be a str, got bytes"),
        ("\ud800", "lone surrogate"),
    ],
)
def test_an_invalid_ordering_key_is_refused_before_anything_is_written(
    engine: sa.Engine, value: object, rule: str
) -> None:
    with pytest.raises(errors.InvalidOrderingKeyError) as info:
        _enqueue(engine, "a", value)
    message = str(info.value)
    assert rule in message and "an ordering key is a str of 1 to 128 characters" in message, message
    assert info.value.field == "ordering_key"
    with pytest.raises(
        errors.InvalidOrderingKeyError, match=r"ordering_key of row 1 \(key 'b'\).*" + rule[:8]
    ):
        with engine.begin() as conn:
            outbox.enqueue_many(conn, [("a", "t", {}, "ok"), ("b", "t", {}, value)])
    assert isinstance(info.value, errors.InvalidPayloadError)  # one except catches every refused row
    assert _keys_by_id(engine) == []


def test_the_longest_and_unicode_ordering_keys_are_accepted(engine: sa.Engine) -> None:
    assert _enqueue(engine, "a", "k" * 128)
    assert _enqueue(engine, "b", "Kunde-Müller / 東京")
    assert [o for _, o in _keys_by_id(engine)] == ["k" * 128, "Kunde-Müller / 東京"]


def test_enqueue_many_writes_each_keys_rows_in_the_lists_order(engine: sa.Engine) -> None:
    # Idempotency keys sorted against the list order, two ordering keys interleaved, rows without a key.
    items = [
        outbox.OutboxItem("z1", "t", {"n": 1}, "k-b"),
        outbox.OutboxItem("y2", "t", {"n": 2}, "k-a"),
        ("m", "t", {"n": 0}),
        outbox.OutboxItem("x3", "t", {"n": 3}, "k-b"),
        ("w4", "t", {"n": 4}, "k-a"),
        outbox.OutboxItem("a5", "t", {"n": 5}, "k-b"),
        ("b", "t", {"n": 0}, None),
    ]
    with engine.begin() as conn:
        assert outbox.enqueue_many(conn, items) == (True,) * 7
    rows = _keys_by_id(engine)
    by_key: dict[str | None, list[str]] = {}
    for key, ordering in rows:
        by_key.setdefault(ordering, []).append(key)
    assert by_key == {"k-b": ["z1", "x3", "a5"], "k-a": ["y2", "w4"], None: ["b", "m"]}
    # A repeat of the set is a no-op, whatever order it comes in.
    with engine.begin() as conn:
        assert outbox.enqueue_many(conn, list(reversed(items))) == (False,) * 7
    assert _keys_by_id(engine) == rows


def test_a_set_over_one_statement_keeps_the_order(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dagster_joblease.storage.rowset.ROWS_PER_STATEMENT", 3)
    items = [(f"key-{99 - i:02d}", "t", {"i": i}, "only") for i in range(10)]
    with engine.begin() as conn:
        outbox.enqueue_many(conn, items)
    assert [k for k, _ in _keys_by_id(engine)] == [k for k, *_ in items]


def _lock_waiters(engine: sa.Engine) -> int:
    """Sessions waiting for an ordering key's enqueue lock (an advisory lock of its class)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                    "AND classid = :cls AND database = (SELECT oid FROM pg_database WHERE datname = "
                    "current_database())"
                ),
                {"cls": store.ORDERING_LOCK_CLASS},
            ).scalar_one()
        )


def test_a_keys_second_enqueue_waits_for_the_first_so_ids_follow_commit_order(pg_engine: sa.Engine) -> None:
    """Without the lock, the second transaction would take a later id yet could commit first: a dispatcher
    would then see (and send) the key's second row while the first is still invisible to it."""
    done: list[object] = []

    def second(ordering_key: str) -> None:
        try:
            done.append(_enqueue(pg_engine, f"second-{ordering_key}", ordering_key))
        except BaseException as exc:
            done.append(exc)

    with pg_engine.begin() as conn:
        assert outbox.enqueue_once(conn, idempotency_key="first", topic="t", payload={}, ordering_key="k")
        other = threading.Thread(target=second, args=("other",))  # another key: not held back
        other.start()
        other.join(60)
        assert done == [True]
        thread = threading.Thread(target=second, args=("k",))
        thread.start()
        wait_until(lambda: _lock_waiters(pg_engine) == 1, timeout=60)
        assert done == [True]  # still waiting: this transaction holds the key
    thread.join(60)
    assert done == [True, True]
    assert [k for k, _ in _keys_by_id(pg_engine)] == ["first", "second-other", "second-k"]


def test_rows_a_key_holds_back_are_not_counted_due(engine: sa.Engine) -> None:
    """What the outbox sensor and the delivery checks read: a key's later rows are not due (no dispatch is
    started for rows nobody may claim), its head is."""
    with engine.begin() as conn:
        outbox.enqueue_many(conn, [(f"k/{i}", "t", {}, "k") for i in range(3)] + [("plain", "t", {})])
    assert outbox.due_summary(engine).due == 2


def _advisory_locks_held(conn: sa.Connection) -> int:
    return int(
        conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() "
                "AND classid IN (:key, :all)"
            ),
            {"key": store.ORDERING_LOCK_CLASS, "all": store.ORDERING_ALL_CLASS},
        ).scalar_one()
    )


def test_a_set_of_many_keys_takes_one_lock_and_keyed_enqueues_wait_for_it(pg_engine: sa.Engine) -> None:
    """Advisory locks fill the server's shared lock table (for every session): a set of 5,000 ordering
    keys takes the one all-keys lock, not 5,000; a small set takes one per key beside it, shared."""
    many = [(f"m/{i}", "t", {}, f"key-{i}") for i in range(5_000)]
    done: list[object] = []
    with pg_engine.begin() as conn:
        outbox.enqueue_many(conn, [(f"f/{i}", "t", {}, f"few-{i}") for i in range(3)])
        assert _advisory_locks_held(conn) == 4
    with pg_engine.begin() as conn:
        outbox.enqueue_many(conn, many)
        assert _advisory_locks_held(conn) == 1

        def keyed() -> None:
            done.append(_enqueue(pg_engine, "after", "unrelated-key"))

        thread = threading.Thread(target=keyed)
        thread.start()
        wait_until(lambda: _all_lock_waiters(pg_engine) == 1, timeout=60)
        assert done == []
    thread.join(60)
    assert done == [True]
    assert _keys_by_id(pg_engine)[-1] == ("after", "unrelated-key")


def _all_lock_waiters(engine: sa.Engine) -> int:
    """Sessions waiting for the all-keys lock."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                    "AND classid = :c"
                ),
                {"c": store.ORDERING_ALL_CLASS},
            ).scalar_one()
        )


def test_a_key_purged_between_the_insert_and_the_read_back_keeps_the_lists_order(
    pg_engine: sa.Engine,
) -> None:
    """Scenario 7 of issue 36: ``enqueue_many`` of an old, already-sent key with the rows after it. The
    INSERT meets the old row; a purge deletes it before the read-back (a trigger, after the INSERT); the
    second round inserts it again, and today's code put it after the rows it precedes in the list."""
    assert _enqueue(pg_engine, "a", "K")
    t = outbox_table
    with pg_engine.begin() as conn:
        conn.execute(sa.update(t).where(t.c.idempotency_key == "a").values(status="SENT"))
        conn.exec_driver_sql(
            "CREATE FUNCTION purge_sent_a() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "DELETE FROM joblease_outbox WHERE idempotency_key = 'a' AND status = 'SENT'; RETURN NULL; END $$"
        )
        conn.exec_driver_sql(
            "CREATE TRIGGER purge_sent_a AFTER INSERT ON joblease_outbox "
            "FOR EACH STATEMENT EXECUTE FUNCTION purge_sent_a()"
        )
    items = [outbox.OutboxItem(k, "t", {"k": k}, "K") for k in ("a", "b", "c")]
    with pg_engine.begin() as conn:
        assert outbox.enqueue_many(conn, items) == (True, True, True)
    assert _keys_by_id(pg_engine) == [("a", "K"), ("b", "K"), ("c", "K")]
