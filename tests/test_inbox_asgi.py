"""InboxMiddleware mounted on a FastAPI app (tests/inbox_app.py), on a sync Inbox and on both kinds of
AsyncInbox, against real PostgreSQL (and SQLite for the sync inbox): replay, 409 under a burst, 422, 400,
retention, fencing, answers not stored, effects rolled back."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import psycopg
import psycopg_pool
import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from psycopg.rows import dict_row
from sqlalchemy.ext.asyncio import create_async_engine

from dagster_joblease import errors
from dagster_joblease.inbox import AsyncInbox, Inbox, InboxMiddleware, core, inbox_connection
from dagster_joblease.storage import create_engine
from dagster_joblease.storage import inbox as store
from tests.inbox_app import build_app, orders, shop_metadata

pytestmark = pytest.mark.anyio

KINDS = ["sync-postgresql", "async-psycopg", "async-sqlalchemy"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclasses.dataclass
class Shop:
    kind: str
    app: FastAPI
    client: httpx.AsyncClient
    engine: sa.Engine
    inbox: Inbox | AsyncInbox[Any]

    async def post(
        self, key: str | None, body: Any = None, *, path: str = "/orders", **headers: str
    ) -> httpx.Response:
        sent = {"Content-Type": "application/json", **headers}
        if key is not None:
            sent["Idempotency-Key"] = key
        content = (
            body if isinstance(body, bytes) else json.dumps(body or {"order_id": 1, "amount": 10}).encode()
        )
        return await self.client.post(path, content=content, headers=sent)

    def applied(self, order_id: int | None = None) -> int:
        stmt = sa.select(sa.func.count()).select_from(orders)
        if order_id is not None:
            stmt = stmt.where(orders.c.order_id == order_id)
        with self.engine.connect() as conn:
            return int(conn.execute(stmt).scalar_one())

    def hold(self) -> Callable[[], None]:
        """Hold every effect until the returned function is called."""
        if self.kind.startswith("sync"):
            event = threading.Event()
            self.app.state.gate = event
            return event.set
        gate = anyio.Event()
        self.app.state.gate = gate
        return gate.set

    async def purge_all(self) -> None:
        purged = [0]

        def done() -> bool:  # completed_at < now - 0 ms: true once the database clock moved on
            with self.engine.connect() as conn:
                return not conn.exec_driver_sql("SELECT count(*) FROM joblease_inbox").scalar_one()

        while not done():
            result = self.inbox.purge(0)
            purged[0] += await result if not isinstance(result, int) else result


def _conninfo(url: str) -> str:
    return "postgresql://" + url.split("://", 1)[1]


async def _shop(kind: str, url: str, **options: Any) -> AsyncIterator[Shop]:
    engine = create_engine(url)
    shop_metadata.create_all(engine)
    closers: list[Any] = []
    inbox: Inbox | AsyncInbox[Any]
    if kind in ("sync-postgresql", "sync-sqlite"):
        inbox = Inbox(engine)
    elif kind == "async-psycopg":
        pool = psycopg_pool.AsyncConnectionPool(_conninfo(url), min_size=1, max_size=20, open=False)
        await pool.open()
        closers.append(pool.close)
        inbox = AsyncInbox(pool.connection)
    else:
        async_engine = create_async_engine(url, pool_size=20)
        closers.append(async_engine.dispose)
        inbox = AsyncInbox(async_engine)
    app = build_app(inbox, **options)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop", timeout=30) as client:
        yield Shop(kind, app, client, engine, inbox)
    for close in closers:
        await close()
    engine.dispose()


@pytest.fixture(params=KINDS)
async def shop(request: pytest.FixtureRequest, pg_url: str) -> AsyncIterator[Shop]:
    async for made in _shop(request.param, pg_url):
        yield made


@pytest.fixture(params=[*KINDS, "sync-sqlite"])
async def any_shop(request: pytest.FixtureRequest) -> AsyncIterator[Shop]:
    url = request.getfixturevalue("sqlite_url" if request.param == "sync-sqlite" else "pg_url")
    async for made in _shop(request.param, url):
        yield made


async def test_first_answer_is_stored_and_replayed(any_shop: Shop) -> None:
    first = await any_shop.post("k-1", {"order_id": 7, "amount": 10})
    assert first.status_code == 201, first.text
    assert first.json() == {"order_id": 7, "amount": 10}
    assert first.headers["location"] == "/orders/7"
    assert first.headers["x-not-stored"] == "first time only"
    assert "idempotent-replayed" not in first.headers

    # The same request in another JSON spelling, the key as an RFC 8941 string: a replay.
    replay = await any_shop.post('"k-1"', b'{ "amount": 10, "order_id": 7 }')
    assert replay.status_code == 201
    assert replay.content == first.content
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers["location"] == "/orders/7"
    assert replay.headers["content-type"] == "application/json"
    assert "x-not-stored" not in replay.headers  # only the named headers are stored
    assert any_shop.applied(7) == 1


async def test_a_burst_on_one_new_key_applies_it_once_and_answers_409(shop: Shop) -> None:
    """16 requests at once on one new key: one applies; the other 15 are told 409 while it runs."""
    release = shop.hold()
    answers: list[httpx.Response] = []

    async def send() -> None:
        answers.append(await shop.post("burst", {"order_id": 16, "amount": 1}))

    async with anyio.create_task_group() as group:
        for _ in range(16):
            group.start_soon(send)
        with anyio.fail_after(30):
            while len(answers) < 15:
                await anyio.sleep(0.01)
        release()
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [201] + [409] * 15, statuses
    for refused in (a for a in answers if a.status_code == 409):
        assert refused.headers["content-type"] == "application/problem+json"
        assert int(refused.headers["retry-after"]) >= 1
    assert shop.applied(16) == 1
    again = await shop.post("burst", {"order_id": 16, "amount": 1})
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"


async def test_another_request_under_the_key_is_422(any_shop: Shop) -> None:
    assert (await any_shop.post("k", {"order_id": 1, "amount": 10})).status_code == 201
    other_body = await any_shop.post("k", {"order_id": 1, "amount": 11})
    assert other_body.status_code == 422
    assert other_body.headers["content-type"] == "application/problem+json"
    assert "'k' was already used" in other_body.json()["detail"]
    other_path = await any_shop.post("k", {"order_id": 1, "amount": 10}, path="/orders/1")
    assert other_path.status_code == 422  # the path is part of the fingerprint
    assert any_shop.applied() == 1


@pytest.mark.parametrize(
    ("headers", "title"),
    [
        ({}, "Missing Idempotency-Key"),
        ({"Idempotency-Key": '"unterminated'}, "Invalid Idempotency-Key"),
        ({"Idempotency-Key": '"bad\\escape"'}, "Invalid Idempotency-Key"),
        ({"Idempotency-Key": "   "}, "Invalid Idempotency-Key"),
        ({"Idempotency-Key": "k" * 321}, "Invalid Idempotency-Key"),
        ({"Idempotency-Key": "k", "Fencing-Token": "-1"}, "Invalid Fencing-Token"),
        ({"Idempotency-Key": "k", "Fencing-Token": "1.5"}, "Invalid Fencing-Token"),
        ({"Idempotency-Key": "k", "Fencing-Token": "9" * 16}, "Invalid Fencing-Token"),
    ],
)
async def test_a_missing_or_malformed_key_is_400(shop: Shop, headers: dict[str, str], title: str) -> None:
    answer = await shop.client.post("/orders", json={"order_id": 1, "amount": 1}, headers=headers)
    assert answer.status_code == 400
    assert answer.json()["title"] == title
    assert shop.applied() == 0


async def test_fencing_tokens_older_than_the_accepted_one_are_refused(shop: Shop) -> None:
    """Kleppmann's fencing: a stale holder (a lower attempt) gets 409, not the newer holder's answer."""
    body = {"order_id": 3, "amount": 5}
    assert (await shop.post("fenced", body, **{"Fencing-Token": "2"})).status_code == 201
    stale = await shop.post("fenced", body, **{"Fencing-Token": "1"})
    assert stale.status_code == 409
    problem = stale.json()
    assert problem["title"] == "Stale fencing token"
    assert (problem["fencing_token"], problem["accepted_fencing_token"]) == (1, 2)
    assert "retry-after" not in stale.headers  # a stale holder must stop, not retry
    newer = await shop.post("fenced", body, **{"Fencing-Token": "3"})
    assert newer.status_code == 201 and newer.headers["idempotent-replayed"] == "true"
    # The replay under token 3 raised the accepted token: 2 is stale now.
    assert (await shop.post("fenced", body, **{"Fencing-Token": "2"})).status_code == 409
    # A request without a token is not fenced: it gets the replay.
    assert (await shop.post("fenced", body)).headers["idempotent-replayed"] == "true"
    assert shop.applied(3) == 1


async def test_after_retention_a_key_is_new_again(shop: Shop) -> None:
    """Why retention must outlast the sender's dedupe_window: a purged key is applied a second time."""
    body = {"order_id": 9, "amount": 1}
    assert (await shop.post("old", body)).status_code == 201
    assert (await shop.post("old", body)).headers["idempotent-replayed"] == "true"
    await shop.purge_all()
    again = await shop.post("old", body)
    assert again.status_code == 201 and "idempotent-replayed" not in again.headers
    assert shop.applied(9) == 2


@pytest.mark.parametrize("status", [500, 503, 409, 429])
async def test_answers_a_sender_retries_are_not_stored_and_roll_back(shop: Shop, status: int) -> None:
    failed = await shop.client.post(
        f"/orders?answer={status}", json={"order_id": 4, "amount": 1}, headers={"Idempotency-Key": "r"}
    )
    assert failed.status_code == status
    assert shop.applied() == 0  # the row the app wrote through the inbox rolled back with it
    retried = await shop.post("r", {"order_id": 4, "amount": 1})
    assert retried.status_code == 201 and "idempotent-replayed" not in retried.headers
    assert shop.applied(4) == 1


async def test_a_final_rejection_is_stored_like_a_success(shop: Shop) -> None:
    rejected = await shop.client.post(
        "/orders?answer=402", json={"order_id": 5, "amount": 1}, headers={"Idempotency-Key": "no"}
    )
    assert rejected.status_code == 402
    replay = await shop.post("no", {"order_id": 5, "amount": 1})
    assert replay.status_code == 402 and replay.headers["idempotent-replayed"] == "true"


async def test_an_effect_that_raises_rolls_back_and_leaves_the_key_new(shop: Shop) -> None:
    with pytest.raises(RuntimeError, match="the effect failed"):
        await shop.client.post(
            "/orders?boom=1", json={"order_id": 6, "amount": 1}, headers={"Idempotency-Key": "b"}
        )
    assert shop.applied() == 0
    assert (await shop.post("b", {"order_id": 6, "amount": 1})).status_code == 201
    assert shop.applied(6) == 1


async def test_other_paths_and_methods_pass_through(shop: Shop) -> None:
    assert (await shop.client.get("/orders/3")).json() == {"order_id": 3}
    with pytest.raises(errors.ConfigurationError, match="no inbox transaction"):
        inbox_connection({"type": "http", "state": {}})


async def test_an_optional_key_lets_keyless_requests_through(pg_url: str) -> None:
    async for shop in _shop("sync-postgresql", pg_url, require_key=False):
        # No key: the app runs without an inbox transaction (its dependency fails, as it should).
        with pytest.raises(errors.ConfigurationError, match="no inbox transaction"):
            await shop.post(None, {"order_id": 1, "amount": 1})
        assert (await shop.post("k", {"order_id": 1, "amount": 1})).status_code == 201


async def test_a_body_over_the_limit_is_413_unread(pg_url: str) -> None:
    async for shop in _shop("async-psycopg", pg_url, max_body_bytes=64):
        big = await shop.post("big", {"order_id": 1, "amount": 1, "pad": "x" * 100})
        assert big.status_code == 413
        assert shop.applied() == 0


def test_stored_headers_may_not_name_framing_headers() -> None:
    with pytest.raises(errors.ConfigurationError, match="content-length"):
        InboxMiddleware(FastAPI(), Inbox(sa.create_engine("sqlite://")), stored_headers=["Content-Length"])


def test_the_middleware_needs_an_inbox() -> None:
    with pytest.raises(errors.ConfigurationError, match="needs an Inbox or an AsyncInbox"):
        InboxMiddleware(FastAPI(), object())  # type: ignore[arg-type]


async def test_the_async_inbox_takes_psycopg_connections_of_any_shape(pg_url: str) -> None:
    """Autocommit connections with a dict row factory and RawCursor's $1 placeholders: the inbox still
    runs its own statements in its own transaction (so an effect that raises rolls back with it)."""
    engine = create_engine(pg_url)
    shop_metadata.create_all(engine)
    pool = psycopg_pool.AsyncConnectionPool(
        _conninfo(pg_url),
        kwargs={"autocommit": True, "row_factory": dict_row, "cursor_factory": psycopg.AsyncRawCursor},
        min_size=1,
        max_size=2,
        open=False,
    )
    await pool.open()
    try:
        inbox = AsyncInbox(pool.connection)

        async def write(conn: Any) -> tuple[int, str]:
            await conn.execute("INSERT INTO shop_order (order_id, amount) VALUES ($1, $2)", (1, 2))
            return 201, "made"

        async def boom(conn: Any) -> tuple[int, str]:
            await write(conn)
            raise RuntimeError("after writing")

        assert (await inbox.process("k", {"v": 1}, write)).replayed is False
        assert (await inbox.process("k", {"v": 1}, write)).replayed is True
        with pytest.raises(RuntimeError, match="after writing"):
            await inbox.process("k2", {"v": 1}, boom)
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(orders)).scalar_one() == 1
    finally:
        await pool.close()
        engine.dispose()


@pytest.mark.parametrize("kind", ["async-psycopg", "async-sqlalchemy"])
async def test_a_key_recorded_first_by_another_transaction_rolls_this_effect_back(
    pg_url: str, kind: str
) -> None:
    """The answer's row and the COMMIT go in one round trip on psycopg: a key another transaction recorded
    meanwhile (here, written without the in-flight lock) must still fail the record, keep the COMMIT
    from applying this effect, and answer the first transaction's answer as a replay."""
    async for shop in _shop(kind, pg_url):
        inbox = shop.inbox
        assert isinstance(inbox, AsyncInbox)
        tx = inbox.transaction("raced", "fp-1")
        assert await tx.begin() is None
        if kind == "async-psycopg":
            await tx.connection.execute("INSERT INTO shop_order (order_id, amount) VALUES (7, 1)")
        else:
            await tx.connection.execute(sa.text("INSERT INTO shop_order (order_id, amount) VALUES (7, 1)"))
        other = inbox.transaction("raced", "fp-1")
        with shop.engine.begin() as conn:  # the other writer's DONE record, committed first
            theirs = core.Answer(201, "theirs", (("content-type", "x/y"),))
            conn.execute(store.RECORD_DONE.postgresql, core.record_params("raced", "fp-1", None, theirs))
        result = await tx.commit(core.Answer(200, "mine", ()))
        assert (result.status_code, result.body, result.replayed) == (201, "theirs", True)
        assert result.headers == (("content-type", "x/y"),)
        assert shop.applied(7) == 0
        assert (await other.begin()) == result  # the key still replays the first answer


async def test_an_effects_own_unique_violation_at_commit_is_an_error_not_a_replay(pg_url: str) -> None:
    """A deferred constraint of the effect's table fails at COMMIT, in the record's round trip: that is
    the effect's error (503, nothing stored), never read as another transaction's record."""
    async for shop in _shop("async-psycopg", pg_url):
        with shop.engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE deferred_effect (n int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
        inbox = shop.inbox
        assert isinstance(inbox, AsyncInbox)

        async def twice(conn: Any) -> tuple[int, str]:
            await conn.execute("INSERT INTO deferred_effect VALUES (1), (1)")
            return 201, "made"

        with pytest.raises(errors.StorageError, match="record an inbox result"):
            await inbox.process("deferred", {"v": 1}, twice)
        with shop.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM deferred_effect").scalar_one() == 0
            assert conn.exec_driver_sql("SELECT count(*) FROM joblease_inbox").scalar_one() == 0


async def test_keys_and_answers_of_any_characters_round_trip_on_psycopg(pg_url: str) -> None:
    """The psycopg session binds its statements client-side (one query string per round trip): quotes,
    backslashes, percent signs, semicolons and non-ASCII in keys, bodies and headers are data, never SQL,
    and a bytes answer keeps its bytes."""
    pool = psycopg_pool.AsyncConnectionPool(_conninfo(pg_url), min_size=1, max_size=2, open=False)
    await pool.open()
    try:
        inbox = AsyncInbox(pool.connection)
        keys = ["it's", "a\\b", "50%s %(x)s", "k'; DROP TABLE joblease_inbox; --", "ключ ☃", '"q"']
        for n, key in enumerate(keys):
            body: str | bytes = f"body {key}" if n % 2 else bytes(range(256)) + key.encode()

            async def effect(conn: Any, body: str | bytes = body, key: str = key) -> tuple[Any, ...]:
                return 201, body, (("x-key", key.encode().hex()),)

            first = await inbox.process(key, {"key": key}, effect)
            again = await inbox.process(key, {"key": key}, effect)
            assert (first.replayed, again.replayed) == (False, True)
            assert (again.status_code, again.body, again.headers) == (
                201,
                body,
                (("x-key", key.encode().hex()),),
            )
            with pytest.raises(errors.InboxConflictError):
                await inbox.process(key, {"key": key, "other": 1}, effect)
        async with pool.connection() as conn:
            assert conn.autocommit is False  # the pool's connections get their own mode back
            count = await (await conn.execute("SELECT count(*) FROM joblease_inbox")).fetchone()
            assert count == (len(keys),)
    finally:
        await pool.close()
