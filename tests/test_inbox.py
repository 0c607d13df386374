"""The inbox contract on real PostgreSQL and SQLite: process once, replay, conflict, in flight, takeover."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from dagster_joblease import errors
from dagster_joblease.inbox import (
    AsyncInbox,
    Inbox,
    InboxResult,
    InboxStatus,
    InvalidInboxInputError,
    request_fingerprint,
)
from dagster_joblease.storage import create_engine, inbox_table
from dagster_joblease.storage.clock import db_now, db_now_plus_ms
from tests.conftest import wait_until

_test_metadata = sa.MetaData()
effect_rows = sa.Table(
    "inbox_test_effect",
    _test_metadata,
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(320), nullable=False),
    sa.Column("note", sa.Text(), nullable=False),
)

# A consumer in its own process: claims the key, writes its effect row, then either finishes or blocks
# (so the test can SIGKILL it inside the effect). Prints "in effect", then its outcome.
CHILD = """
import sys, time
import sqlalchemy as sa
from dagster_joblease import errors
from dagster_joblease.inbox import Inbox
from dagster_joblease.storage import create_engine

url, key, lock_ms, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
engine = create_engine(url)

def effect(conn):
    conn.execute(sa.text("INSERT INTO inbox_test_effect (key, note) VALUES (:k, 'child')"), {"k": key})
    print("in effect", flush=True)
    if mode == "block":
        time.sleep(60)
    return 200, "from child"

try:
    result = Inbox(engine, lock_ms=lock_ms).process(key, {"v": 1}, effect)
    print("replayed" if result.replayed else "done", flush=True)
except errors.InboxInProgressError:
    print("in_progress", flush=True)
"""


class BlockingAsyncInbox:
    """An AsyncInbox on SQLAlchemy's async engine, each call on an event loop of the calling thread (so
    threads can race it as they race the sync one): the same tests run on it.

    The sync effects run through ``AsyncConnection.run_sync`` on the async transaction's connection. No
    pool: a connection belongs to the loop that opened it.
    """

    def __init__(self, url: str, lock_ms: int) -> None:
        self._engine = create_async_engine(url, poolclass=sa.pool.NullPool)
        self._inbox = AsyncInbox(self._engine, lock_ms=lock_ms)

    def process(self, key: Any, payload: Any, effect: Any, *, fence: int | None = None) -> InboxResult:
        async def run(conn: Any) -> Any:
            return await conn.run_sync(effect)

        wrapped = run if callable(effect) else effect
        return anyio.run(functools.partial(self._inbox.process, key, payload, wrapped, fence=fence))

    def purge(self, older_than_ms: int) -> int:
        return anyio.run(self._inbox.purge, older_than_ms)

    def close(self) -> None:
        anyio.run(self._engine.dispose)


INBOX_KINDS = ["sqlite/sync", "postgresql/sync", "postgresql/async"]


@pytest.fixture(params=INBOX_KINDS)
def inbox_kind(request: pytest.FixtureRequest) -> str:
    """The sync Inbox on each backend, and the AsyncInbox on PostgreSQL (SQLite keeps the sync one)."""
    return str(request.param)


@pytest.fixture
def db_url(request: pytest.FixtureRequest, inbox_kind: str) -> str:
    """The database of the inbox under test (overrides conftest's: one per inbox kind)."""
    return str(request.getfixturevalue("pg_url" if inbox_kind.startswith("postgresql") else "sqlite_url"))


@contextlib.contextmanager
def _inbox_of(kind: str, engine: sa.Engine) -> Iterator[Any]:
    """The sync Inbox (``sync``) or the AsyncInbox driven from this thread (``async``) on ``engine``."""
    _test_metadata.create_all(engine)
    if kind == "sync":
        yield Inbox(engine, lock_ms=30_000)
        return
    blocking = BlockingAsyncInbox(engine.url.render_as_string(hide_password=False), 30_000)
    try:
        yield blocking
    finally:
        blocking.close()


@pytest.fixture
def inbox(inbox_kind: str, engine: sa.Engine) -> Iterator[Any]:
    with _inbox_of(inbox_kind.rsplit("/", 1)[1], engine) as made:
        yield made


@pytest.fixture(params=["sync", "async"])
def pg_inbox(request: pytest.FixtureRequest, pg_engine: sa.Engine) -> Iterator[Any]:
    with _inbox_of(request.param, pg_engine) as made:
        yield made


def _writer(key: str, note: str, response: tuple[Any, Any] = (201, '{"ok": true}')) -> Any:
    calls: list[str] = []

    def effect(conn: sa.Connection) -> tuple[Any, Any]:
        calls.append(note)
        conn.execute(effect_rows.insert().values(key=key, note=note))
        return response

    effect.calls = calls  # type: ignore[attr-defined]
    return effect


def _notes(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(effect_rows.c.note).order_by(effect_rows.c.id)).scalars())


def _inbox_row(engine: sa.Engine, key: str) -> sa.Row[Any] | None:
    with engine.connect() as conn:
        return conn.execute(sa.select(inbox_table).where(inbox_table.c.idempotency_key == key)).first()


def _insert_claim(engine: sa.Engine, key: str, payload: Any, lock_ms: int) -> None:
    """Another consumer's claim, live (lock_ms > 0) or already expired on the database clock (< 0)."""
    with engine.begin() as conn:
        conn.execute(
            inbox_table.insert().values(
                idempotency_key=key,
                payload_sha256=request_fingerprint(payload),
                status=InboxStatus.IN_PROGRESS.value,
                lock_token="someone-else",
                locked_until=db_now_plus_ms(sa.literal(lock_ms, sa.BigInteger())),
                created_at=db_now(),
            )
        )


def test_first_time_runs_the_effect_and_a_replay_returns_the_stored_response(
    inbox: Inbox, engine: sa.Engine
) -> None:
    effect = _writer("k", "first")
    first = inbox.process("k", {"order": 1, "lines": [1, 2]}, effect)
    assert first == InboxResult(status_code=201, body='{"ok": true}', replayed=False)
    row = _inbox_row(engine, "k")
    assert row is not None and row.status == InboxStatus.DONE.value and row.lock_token is None
    assert row.completed_at is not None

    # Same payload, other key order and spelling (a raw request body): replayed, effect not run again.
    again = _writer("k", "second")
    replay = inbox.process("k", b'{"lines": [1, 2], "order": 1}', again)
    assert replay == InboxResult(status_code=201, body='{"ok": true}', replayed=True)
    assert again.calls == []
    assert _notes(engine) == ["first"]


def test_non_2xx_results_are_recorded_and_replayed(inbox: Inbox, engine: sa.Engine) -> None:
    """A deliberate rejection is a completed result: it is stored and replayed like a success."""
    rejected = inbox.process("r", "plain text body", _writer("r", "rejected", (400, "no such account")))
    assert (rejected.status_code, rejected.replayed) == (400, False)
    assert inbox.process("r", "plain text body", _writer("r", "again")) == InboxResult(
        400, "no such account", True
    )
    assert _notes(engine) == ["rejected"]


def test_same_key_with_another_payload_is_a_conflict(inbox: Inbox, engine: sa.Engine) -> None:
    inbox.process("k", {"amount": 10}, _writer("k", "first"))
    with pytest.raises(errors.InboxConflictError, match="'k' was already used with a different payload"):
        inbox.process("k", {"amount": 11}, _writer("k", "second"))
    with pytest.raises(errors.InboxConflictError):
        inbox.process("k", b"not json at all", _writer("k", "third"))
    assert _notes(engine) == ["first"]


def test_live_claim_answers_in_progress_and_another_payload_still_conflicts(
    inbox: Inbox, engine: sa.Engine
) -> None:
    _insert_claim(engine, "busy", {"v": 1}, lock_ms=60_000)
    effect = _writer("busy", "mine")
    with pytest.raises(errors.InboxInProgressError, match="'busy' is being processed") as busy:
        inbox.process("busy", {"v": 1}, effect)
    # The claim's remaining lock on the database clock: what a fair Retry-After says.
    assert busy.value.retry_after_ms is not None and 50_000 < busy.value.retry_after_ms <= 60_000
    with pytest.raises(errors.InboxConflictError):
        inbox.process("busy", {"v": 2}, effect)
    assert effect.calls == []
    row = _inbox_row(engine, "busy")
    assert row is not None and row.lock_token == "someone-else"


def test_expired_claim_is_taken_over_on_the_database_clock(inbox: Inbox, engine: sa.Engine) -> None:
    _insert_claim(engine, "stale", {"v": 1}, lock_ms=-1_000)
    assert inbox.process("stale", {"v": 1}, _writer("stale", "taken over")).replayed is False
    # A stale claim never completed, so it holds no result: a takeover may bring another payload too.
    _insert_claim(engine, "stale-2", {"v": 1}, lock_ms=-1_000)
    assert inbox.process("stale-2", {"v": 2}, _writer("stale-2", "other payload")).status_code == 201
    assert _notes(engine) == ["taken over", "other payload"]
    row = _inbox_row(engine, "stale-2")
    assert row is not None and row.status == InboxStatus.DONE.value
    assert row.payload_sha256 == request_fingerprint({"v": 2})


def test_failing_effect_rolls_back_and_releases_the_key(inbox: Inbox, engine: sa.Engine) -> None:
    def boom(conn: sa.Connection) -> tuple[int, str]:
        conn.execute(effect_rows.insert().values(key="f", note="half-done"))
        raise RuntimeError("downstream of the downstream is down")

    with pytest.raises(RuntimeError, match="downstream of the downstream"):
        inbox.process("f", {"v": 1}, boom)
    assert _notes(engine) == []
    assert _inbox_row(engine, "f") is None  # failures are not stored: the key is free at once
    assert inbox.process("f", {"v": 1}, _writer("f", "retried")).replayed is False
    assert _notes(engine) == ["retried"]


@pytest.mark.parametrize("bad", [(99, "x"), (True, "x"), "200", (200, 7), (200, "x", "no headers"), None])
def test_malformed_effect_result_rolls_the_effect_back(inbox: Inbox, engine: sa.Engine, bad: Any) -> None:
    """The record write fails after the effect wrote its row: neither commits."""
    with pytest.raises(InvalidInboxInputError, match="effect result"):
        inbox.process("m", {"v": 1}, _writer("m", "effect", bad))
    assert _notes(engine) == []
    assert _inbox_row(engine, "m") is None


@pytest.mark.postgres_only
def test_record_rejected_by_the_database_rolls_the_effect_back(pg_inbox: Inbox, pg_engine: sa.Engine) -> None:
    # PostgreSQL text cannot hold NUL: the DONE record fails inside the effect's transaction.
    with pytest.raises(errors.StorageError, match="record an inbox result"):
        pg_inbox.process("nul", {"v": 1}, _writer("nul", "effect", (200, "bad\x00body")))
    assert _notes(pg_engine) == []
    assert _inbox_row(pg_engine, "nul") is None


@pytest.mark.postgres_only
def test_concurrent_caller_gets_in_progress_while_the_effect_runs(
    pg_inbox: Inbox, pg_engine: sa.Engine
) -> None:
    entered, release = threading.Event(), threading.Event()
    results: list[InboxResult] = []

    def slow(conn: sa.Connection) -> tuple[int, str]:
        conn.execute(effect_rows.insert().values(key="slow", note="slow"))
        entered.set()
        assert release.wait(10)
        return 200, "slow done"

    worker = threading.Thread(target=lambda: results.append(pg_inbox.process("slow", {"v": 1}, slow)))
    worker.start()
    assert entered.wait(10)
    second = _writer("slow", "second")
    with pytest.raises(errors.InboxInProgressError):
        pg_inbox.process("slow", {"v": 1}, second)
    release.set()
    worker.join(10)
    assert results == [InboxResult(200, "slow done", False)]
    assert pg_inbox.process("slow", {"v": 1}, second) == InboxResult(200, "slow done", True)
    assert second.calls == []
    assert _notes(pg_engine) == ["slow"]


@pytest.mark.postgres_only
def test_effect_stuck_past_its_lock_loses_its_session_and_rolls_back(pg_engine: sa.Engine) -> None:
    """A consumer idle in its effect past lock_ms loses its transaction; another one applies the key."""
    _test_metadata.create_all(pg_engine)
    short = Inbox(pg_engine, lock_ms=300)
    patient = Inbox(pg_engine, lock_ms=30_000)
    on_time = _writer("late", "on time", (201, "on time"))

    def taken_over() -> bool:
        try:
            return patient.process("late", {"v": 1}, on_time).status_code == 201
        except errors.InboxInProgressError:
            return False

    def stuck(conn: sa.Connection) -> tuple[int, str]:
        conn.execute(effect_rows.insert().values(key="late", note="late"))
        wait_until(taken_over)  # the server ends our session after 300 ms idle; the key is free again
        return 200, "late"

    with pytest.raises(errors.StorageError):
        short.process("late", {"v": 1}, stuck)
    assert _notes(pg_engine) == ["on time"]
    assert short.process("late", {"v": 1}, _writer("late", "x")) == InboxResult(201, "on time", True)


def _child(db_url: str, key: str, lock_ms: int, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, db_url, key, str(lock_ms), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.chaos
def test_consumer_killed_inside_the_effect_leaves_the_key_new(
    db_url: str, inbox: Inbox, engine: sa.Engine
) -> None:
    child = _child(db_url, "crash", 500, "block")
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line == "in effect\n", child.stderr.read() if child.stderr else line
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    child.stdout.close()
    if child.stderr:
        child.stderr.close()

    # The key and the effect commit together or not at all: the crash left neither behind.
    row = _inbox_row(engine, "crash")
    assert row is None or row.status != InboxStatus.DONE.value
    assert _notes(engine) == []

    effect = _writer("crash", "survivor")

    def processed() -> bool:
        try:
            return not inbox.process("crash", {"v": 1}, effect).replayed
        except errors.InboxInProgressError:
            return False

    wait_until(processed)
    assert _notes(engine) == ["survivor"]


@pytest.mark.chaos
def test_racing_processes_apply_the_effect_once(db_url: str, inbox: Inbox, engine: sa.Engine) -> None:
    children = [_child(db_url, "race", 30_000, "finish") for _ in range(4)]
    outcomes = []
    for child in children:
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        outcomes.append(out.splitlines()[-1])
    assert outcomes.count("done") == 1
    assert set(outcomes) <= {"done", "replayed", "in_progress"}
    assert _notes(engine) == ["child"]
    assert inbox.process("race", {"v": 1}, _writer("race", "late")) == InboxResult(200, "from child", True)


@pytest.mark.parametrize(
    ("key", "rule"),
    [
        ("", "blank"),
        ("   ", "blank"),
        (None, "must be a str"),
        (42, "must be a str"),
        ("k" * 321, "at most 320"),
        ("bad\nkey", "control character U+000A"),
        ("bad\x7fkey", "control character U+007F"),
    ],
)
def test_invalid_keys_are_refused_before_any_write(
    inbox: Inbox, engine: sa.Engine, key: Any, rule: str
) -> None:
    effect = _writer("x", "never")
    with pytest.raises(InvalidInboxInputError, match=re.escape(rule)) as caught:
        inbox.process(key, {"v": 1}, effect)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, errors.JobLeaseError)
    assert "invalid inbox idempotency_key" in str(caught.value)
    assert effect.calls == []
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(inbox_table)).scalar_one() == 0


def test_longest_allowed_key_works(inbox: Inbox) -> None:
    key = "k" * 320
    assert inbox.process(key, {"v": 1}, _writer(key, "long")).status_code == 201


@pytest.mark.parametrize("lock_ms", [0, -5, 1.5, True, "100", 24 * 3600 * 1000 + 1])
def test_invalid_lock_ms_is_refused(engine: sa.Engine, lock_ms: Any) -> None:
    with pytest.raises(InvalidInboxInputError, match="lock_ms"):
        Inbox(engine, lock_ms=lock_ms)


def test_effect_must_be_callable(inbox: Inbox) -> None:
    with pytest.raises(InvalidInboxInputError, match="not callable"):
        inbox.process("k", {"v": 1}, "apply")  # type: ignore[arg-type]


def test_purge_removes_only_old_completed_keys(inbox: Inbox, engine: sa.Engine) -> None:
    inbox.process("a", {"v": 1}, _writer("a", "a"))
    inbox.process("b", {"v": 1}, _writer("b", "b"))
    _insert_claim(engine, "in-flight", {"v": 1}, lock_ms=60_000)
    assert inbox.purge(3_600_000) == 0
    purged = [0]

    def both_purged() -> bool:  # completed_at < now - 0 ms: true once the database clock has moved on
        purged[0] += inbox.purge(0)
        return purged[0] == 2

    wait_until(both_purged)
    assert _inbox_row(engine, "in-flight") is not None
    # After retention a key is new again: the effect runs a second time (why retention must be long).
    assert inbox.process("a", {"v": 1}, _writer("a", "a again")).replayed is False
    assert _notes(engine) == ["a", "b", "a again"]
    with pytest.raises(InvalidInboxInputError, match="older_than_ms"):
        inbox.purge(-1)


def test_fingerprint_ignores_json_spelling_and_hashes_other_bodies_raw() -> None:
    assert request_fingerprint({"b": [1, 2], "a": "é"}) == request_fingerprint(b'{"a":"\\u00e9", "b":[1,2]}')
    assert request_fingerprint('{"a": 1}') == request_fingerprint(b'{"a":1}') == request_fingerprint({"a": 1})
    assert request_fingerprint(b"hello") == request_fingerprint("hello") != request_fingerprint(b"hello ")
    assert request_fingerprint(b"\xff\xfe") != request_fingerprint(b"\xff\xfd")
    assert request_fingerprint(b'{"a": NaN}') != request_fingerprint(b'{"a": null}')
    with pytest.raises(errors.InvalidPayloadError):
        request_fingerprint({"a": object()})


@pytest.mark.postgres_only
def test_without_server_side_prepared_statements(pg_url: str) -> None:
    """Behind PgBouncer's transaction pooling (?prepare_threshold=none) nothing is PREPAREd."""
    engine = create_engine(pg_url + "?prepare_threshold=none")
    try:
        _test_metadata.create_all(engine)
        inbox = Inbox(engine)
        assert inbox.process("pgb", {"v": 1}, _writer("pgb", "first")).replayed is False
        assert inbox.process("pgb", {"v": 1}, _writer("pgb", "again")).replayed is True
        with pytest.raises(errors.InboxConflictError):
            inbox.process("pgb", {"v": 2}, _writer("pgb", "other"))
        with engine.connect() as conn:
            prepared = conn.exec_driver_sql("SELECT count(*) FROM pg_prepared_statements").scalar_one()
        assert prepared == 0
        assert _notes(engine) == ["first"]
    finally:
        engine.dispose()


@pytest.mark.postgres_only
def test_statements_are_prepared_at_protocol_level_only(pg_url: str) -> None:
    """No SQL-level PREPARE (PgBouncer's max_prepared_statements cannot see those): psycopg's own, after
    its threshold, one rule (?prepare_threshold=none) for the whole library; after DEALLOCATE ALL they
    come back."""
    engine = create_engine(pg_url, pool_size=1, max_overflow=0)
    try:
        _test_metadata.create_all(engine)
        inbox = Inbox(engine)
        for n in range(8):
            inbox.process(f"k{n}", {"v": 1}, _writer(f"k{n}", "a"))
        with pytest.raises(errors.InboxConflictError):
            inbox.process("k0", {"v": 2}, _writer("k0", "other"))
        with engine.connect() as conn:  # the pool's only connection: the one the inbox prepared on
            listed = "SELECT from_sql, count(*) FROM pg_prepared_statements GROUP BY from_sql"
            (from_sql, count), *more = conn.exec_driver_sql(listed).fetchall()
            assert (from_sql, more) == (False, []) and count >= 3  # lock, lookup, record (at least)
            conn.exec_driver_sql("DEALLOCATE ALL")
            conn.commit()
        assert inbox.process("b", {"v": 1}, _writer("b", "b")).replayed is False
        assert inbox.process("k1", {"v": 1}, _writer("k1", "again")).replayed is True
        assert len(_notes(engine)) == 9
    finally:
        engine.dispose()


def test_answers_keep_their_bytes_and_headers(inbox: Any, engine: sa.Engine) -> None:
    headers = [("Content-Type", "application/octet-stream"), ("Location", "/blobs/1")]
    first = inbox.process("h", {"v": 1}, _writer("h", "first", (201, b"\x00\xffbin", headers)))
    assert first == InboxResult(201, b"\x00\xffbin", False, tuple(headers))
    replay = inbox.process("h", {"v": 1}, _writer("h", "again"))
    assert replay == InboxResult(201, b"\x00\xffbin", True, tuple(headers))
    assert replay.content == b"\x00\xffbin" and InboxResult(200, "é", True).content == "é".encode()
    assert _notes(engine) == ["first"]


def test_a_lower_fencing_number_than_the_accepted_one_is_refused(inbox: Any, engine: sa.Engine) -> None:
    """A stale holder (its lease reclaimed: a lower attempt) is refused, not handed the newer answer."""
    inbox.process("f", {"v": 1}, _writer("f", "holder 2"), fence=2)
    with pytest.raises(errors.InboxStaleFenceError, match="token 2 was already accepted") as stale:
        inbox.process("f", {"v": 1}, _writer("f", "holder 1"), fence=1)
    assert (stale.value.fence, stale.value.accepted_fence) == (1, 2)
    assert inbox.process("f", {"v": 1}, _writer("f", "holder 5"), fence=5).replayed
    with pytest.raises(errors.InboxStaleFenceError):  # the replay under 5 raised the accepted number
        inbox.process("f", {"v": 1}, _writer("f", "holder 4"), fence=4)
    with pytest.raises(errors.InboxStaleFenceError):  # stale comes first, even with another payload
        inbox.process("f", {"v": 2}, _writer("f", "holder 3"), fence=3)
    assert inbox.process("f", {"v": 1}, _writer("f", "unfenced")).replayed  # no number: not fenced
    assert _notes(engine) == ["holder 2"]
    row = _inbox_row(engine, "f")
    assert row is not None and row.fence == 5


@pytest.mark.parametrize("fence", [-1, True, "2", 1.0, 10**15])
def test_invalid_fencing_numbers_are_refused(inbox: Any, fence: Any) -> None:
    with pytest.raises(InvalidInboxInputError, match="fence"):
        inbox.process("k", {"v": 1}, _writer("k", "never"), fence=fence)
