"""InboxMiddleware in a FastAPI app served by real uvicorn over real sockets (issue 38): a burst on SQLite,
one answer per database failure, background tasks outside the key's transaction, the request's own scope.

The app is tests/inbox_app.py's shop with two more routes under the middleware: ``/orders/receipt`` adds a
background task (held on a gate, or raising) that writes a ``shop_receipt`` row on its own connection, and
sets ``request.state.marked``; an outer pure-ASGI middleware records what it sees of the scope afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.to_thread
import httpx
import psycopg_pool
import pytest
import sqlalchemy as sa
import uvicorn
from fastapi import BackgroundTasks, FastAPI, Request, Response
from sqlalchemy.ext.asyncio import create_async_engine

from dagster_joblease.inbox.aio import AsyncInbox
from dagster_joblease.inbox.asgi import (
    ASGIApp,
    Receive,
    RequestParts,
    Scope,
    Send,
    fingerprint_request,
    inbox_connection,
)
from dagster_joblease.inbox.core import iso_utc
from dagster_joblease.inbox.sync import Inbox
from dagster_joblease.receiver.server import listening_socket
from dagster_joblease.storage.engine import create_engine
from dagster_joblease.storage.schema import inbox_table
from tests.inbox_app import build_app, orders, shop_metadata

pytestmark = pytest.mark.anyio

receipts = sa.Table(
    "shop_receipt",
    shop_metadata,
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.Integer(), nullable=False),
)

#: anyio's default worker-thread limit: what FastAPI's sync endpoints and the sync inbox share.
THREADS = 40


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Seen:
    """An outer ASGI middleware (an access log, metrics): what it sees of the scope once the app is done."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.scopes: list[dict[str, Any]] = []
        self.arrived = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.arrived += 1
        await self.app(scope, receive, send)
        if scope["type"] == "http":
            route = scope.get("route")
            self.scopes.append(
                {
                    "route": getattr(route, "path", None),
                    "path_params": scope.get("path_params"),
                    "marked": scope.get("state", {}).get("marked"),
                }
            )


def _add_receipt_route(app: FastAPI, engine: sa.Engine, sync: bool) -> None:
    """``POST /orders/{order_id}/receipt``: the effect, then a background task writing a receipt on its own
    connection after waiting for ``app.state.background_gate`` (or raising with ``?boom=1``)."""

    def receipt(order_id: int, boom: int) -> None:
        gate: threading.Event = app.state.background_gate
        assert gate.wait(60)
        with engine.begin() as conn:
            conn.execute(receipts.insert().values(order_id=order_id))
        if boom:
            raise RuntimeError("the background task failed")

    def answer(request: Request, order_id: int, tasks: BackgroundTasks, response: Response, boom: int) -> Any:
        request.state.marked = "by the endpoint"
        tasks.add_task(receipt, order_id, boom)
        response.status_code = 201
        return {"order_id": order_id}

    if sync:

        @app.post("/orders/{order_id}/receipt")
        def sync_receipt(
            request: Request, order_id: int, tasks: BackgroundTasks, response: Response, boom: int = 0
        ) -> Any:
            conn = inbox_connection(request)
            conn.execute(orders.insert().values(order_id=order_id, amount=1))
            return answer(request, order_id, tasks, response, boom)

    else:

        @app.post("/orders/{order_id}/receipt")
        async def async_receipt(
            request: Request, order_id: int, tasks: BackgroundTasks, response: Response, boom: int = 0
        ) -> Any:
            conn = inbox_connection(request)
            await conn.execute("INSERT INTO shop_order (order_id, amount) VALUES (%s, 1)", (order_id,))
            return answer(request, order_id, tasks, response, boom)


@dataclasses.dataclass
class Served:
    """The shop on uvicorn in a thread of its own (its own event loop), at :attr:`url`."""

    kind: str
    url: str
    app: FastAPI
    seen: Seen
    engine: sa.Engine
    inbox: Inbox | AsyncInbox[Any]

    def count(self, table: sa.Table, order_id: int | None = None) -> int:
        stmt = sa.select(sa.func.count()).select_from(table)
        if order_id is not None:
            stmt = stmt.where(table.c.order_id == order_id)
        with self.engine.connect() as conn:
            return int(conn.execute(stmt).scalar_one())


@contextlib.asynccontextmanager
async def _inbox(kind: str, url: str, engine: sa.Engine, **options: Any) -> AsyncIterator[Any]:
    if kind.startswith("sync"):
        yield Inbox(engine)
    elif kind == "async-psycopg":
        conninfo = "postgresql://" + url.split("://", 1)[1]
        pool = psycopg_pool.AsyncConnectionPool(
            conninfo, min_size=0, max_size=options.get("max_size", 20), timeout=1.0, open=False
        )
        await pool.open(wait=False)
        try:
            yield AsyncInbox(pool.connection)
        finally:
            await pool.close()
    else:
        async_engine = create_async_engine(url, pool_size=5)
        try:
            yield AsyncInbox(async_engine)
        finally:
            await async_engine.dispose()


@contextlib.contextmanager
def serve(
    kind: str,
    url: str,
    engine: sa.Engine | None = None,
    *,
    tables: bool = True,
    middleware: dict[str, Any] | None = None,
    **options: Any,
) -> Iterator[Served]:
    """Serve the shop (``kind``: sync-postgresql, sync-sqlite, async-psycopg, async-sqlalchemy) on uvicorn;
    ``engine`` (default one on ``url``) is the sync inbox's and the receipts'; ``tables``: create the
    shop's tables on it first."""
    own_engine = engine is None
    engine = engine or create_engine(url)
    if tables:
        shop_metadata.create_all(engine)
    sock = listening_socket("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    made: dict[str, Any] = {}
    ready = threading.Event()

    async def main() -> None:
        try:
            async with _inbox(kind, url, engine, **options) as inbox:
                app = build_app(inbox, **(middleware or {}))
                app.state.background_gate = threading.Event()
                _add_receipt_route(app, engine, kind.startswith("sync"))
                seen = Seen(app)
                server = uvicorn.Server(
                    uvicorn.Config(seen, lifespan="off", log_config=None, access_log=False)
                )
                made.update(app=app, seen=seen, server=server, inbox=inbox)
                serving = asyncio.ensure_future(server.serve(sockets=[sock]))
                while not server.started and not serving.done():
                    await asyncio.sleep(0.01)
                ready.set()
                await serving
        finally:
            ready.set()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    ready.wait(60)
    try:
        assert "server" in made and made["server"].started, "uvicorn did not start"
        yield Served(kind, f"http://{host}:{port}", made["app"], made["seen"], engine, made["inbox"])
    finally:
        if "app" in made:
            made["app"].state.background_gate.set()
        if "server" in made:
            made["server"].should_exit = True
        thread.join(30)
        sock.close()
        if own_engine:
            engine.dispose()


def _order(order_id: int) -> bytes:
    return json.dumps({"order_id": order_id, "amount": 10}).encode()


async def _post(
    client: httpx.AsyncClient,
    served: Served,
    key: str,
    order_id: int,
    path: str = "/orders",
    tenant: str | None = None,
    amount: int = 10,
) -> httpx.Response:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    if tenant is not None:
        headers["X-Tenant"] = tenant
    body = json.dumps({"order_id": order_id, "amount": amount}).encode()
    return await client.post(served.url + path, content=body, headers=headers)


# -- scenario 1: a burst on SQLite ---------------------------------------------------------------------------


@pytest.mark.parametrize("times", [1, 2])
async def test_a_burst_on_sqlite_larger_than_the_thread_pool_is_served(sqlite_url: str, times: int) -> None:
    """The docs' shape (sync Inbox on SQLite, sync endpoints): a burst of distinct keys at once, as many
    as the worker threads and twice that. Every request is applied and answered 201. Before, the burst
    waited for SQLite's write lock inside worker threads while the holder needed one more thread for its
    endpoint and commit: every thread waited out SQLite's 30 s busy timeout and most answered 5xx."""
    burst = THREADS * times + 5
    with serve("sync-sqlite", sqlite_url) as served:
        limits = httpx.Limits(max_connections=burst, max_keepalive_connections=burst)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            answers: list[httpx.Response] = []

            async def one(n: int) -> None:
                answers.append(await _post(client, served, f"burst-{n}", n))

            async with anyio.create_task_group() as group:
                for n in range(burst):
                    group.start_soon(one, n)
        statuses = sorted(a.status_code for a in answers)
        assert statuses == [201] * burst, statuses
        assert served.count(orders) == burst


# -- scenario 2: one answer per database failure ------------------------------------------------------------


def _assert_503(answer: httpx.Response) -> None:
    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.headers["retry-after"] == "1"
    assert answer.json()["title"] == "Service Unavailable"


@pytest.mark.parametrize("kind", ["sync-postgresql", "async-psycopg"])
async def test_a_database_that_is_down_is_503_on_either_inbox(kind: str) -> None:
    """A database nobody listens for (a closed port): the documented 503 problem with Retry-After on
    the sync inbox too (it answered a raw 500: its connect was outside the error translation)."""
    down = "postgresql+psycopg://postgres@127.0.0.1:9/nowhere?connect_timeout=2"
    with serve(kind, down, tables=False) as served:
        async with httpx.AsyncClient(timeout=30) as client:
            _assert_503(await _post(client, served, "down", 1))


@pytest.mark.parametrize("kind", ["sync-postgresql", "async-psycopg"])
async def test_a_pool_that_times_out_is_503_on_either_inbox(kind: str, pg_url: str) -> None:
    """Every connection of the inbox's pool taken and none back within its timeout: 503 with Retry-After
    on both inboxes (the sync one answered a raw 500 for SQLAlchemy's pool timeout)."""
    engine = create_engine(pg_url, pool_size=1, max_overflow=0, pool_timeout=0.5)
    try:
        with serve(kind, pg_url, engine=engine, max_size=1) as served:
            async with httpx.AsyncClient(timeout=30) as client, _holding_the_pool(served):
                _assert_503(await _post(client, served, "starved", 2))
            async with httpx.AsyncClient(timeout=30) as client:
                assert (await _post(client, served, "starved", 2)).status_code == 201
    finally:
        engine.dispose()


@contextlib.asynccontextmanager
async def _holding_the_pool(served: Served) -> AsyncIterator[None]:
    """Hold the inbox's one pooled connection while the block runs."""
    inbox = served.inbox
    if isinstance(inbox, Inbox):
        with inbox.engine.connect():
            yield
        return
    held, done = threading.Event(), threading.Event()

    @served.app.post("/hold-connection")
    async def hold_connection() -> Any:
        async with inbox.source():
            held.set()
            await anyio.to_thread.run_sync(done.wait)
        return {}

    async with httpx.AsyncClient(timeout=60) as client, anyio.create_task_group() as group:
        group.start_soon(client.post, served.url + "/hold-connection")
        assert await anyio.to_thread.run_sync(held.wait, 30)
        try:
            yield
        finally:
            done.set()


async def _until(condition: Any, timeout_s: float = 30) -> None:
    with anyio.fail_after(timeout_s):
        while not condition():
            await anyio.sleep(0.02)


# -- scenario 3: background tasks run after the key's transaction -------------------------------------------

KINDS = ["sync-postgresql", "async-psycopg", "sync-sqlite"]


@pytest.fixture(params=KINDS)
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    url = request.getfixturevalue("sqlite_url" if request.param == "sync-sqlite" else "pg_url")
    with serve(request.param, url) as made:
        yield made


async def test_the_answer_and_the_effect_commit_before_background_tasks_run(served: Served) -> None:
    """A background task still running (held on a gate): the 201 has arrived, the effect is committed
    (another connection sees it), and a repeat is a replay rather than 409 for a key still in flight.
    Before, the 201 waited for the background task inside the key's transaction."""
    async with httpx.AsyncClient(timeout=30) as client:
        first = await _post(client, served, "bg", 7, "/orders/7/receipt")
        assert first.status_code == 201, first.text
        assert served.count(orders, 7) == 1  # committed while the background task still waits
        again = await _post(client, served, "bg", 7, "/orders/7/receipt")
        assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
        assert served.count(receipts) == 0
        served.app.state.background_gate.set()
        await _until(lambda: served.count(receipts, 7) == 1)


async def test_a_background_task_that_raises_leaves_the_answer_and_the_effect(served: Served) -> None:
    """A background task that raises after the answer: the 201 stands and the effect stays committed, so
    the sender's retry is a replay (one order, one receipt), not a second run of the endpoint."""
    served.app.state.background_gate.set()
    async with httpx.AsyncClient(timeout=30) as client:
        first = await _post(client, served, "bg-boom", 8, "/orders/8/receipt?boom=1")
        assert first.status_code == 201, first.text
        await _until(lambda: served.count(receipts, 8) == 1)
    # A new connection: uvicorn closes the one whose app raised (after its answer, as without the inbox).
    async with httpx.AsyncClient(timeout=30) as client:
        retry = await _post(client, served, "bg-boom", 8, "/orders/8/receipt?boom=1")
        assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert (served.count(orders, 8), served.count(receipts, 8)) == (1, 1)


# -- scenario 4: the app runs on the request's own scope ----------------------------------------------------


async def test_the_middlewares_around_the_inbox_see_the_apps_scope(served: Served) -> None:
    """What the endpoint sets in ``request.state`` and the router's ``route``/``path_params`` reach the
    middlewares around the inbox (they saw a copy's original: nothing)."""
    served.app.state.background_gate.set()
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await _post(client, served, "scope", 9, "/orders/9/receipt")).status_code == 201
    await _until(lambda: len(served.seen.scopes) == 1)
    assert served.seen.scopes == [
        {"route": "/orders/{order_id}/receipt", "path_params": {"order_id": "9"}, "marked": "by the endpoint"}
    ]


# -- scenarios 6-9: keys that belong to their caller ------------------------------------------------------


def _tenant(scope: Scope) -> str | None:
    """The caller, as an API behind an authenticating proxy would know it (here a header)."""
    return dict(scope["headers"]).get(b"x-tenant", b"").decode() or None


class ThreadGate:
    """A gate the test opens from its thread, awaited by async endpoints in the server's event loop."""

    def __init__(self) -> None:
        self.event = threading.Event()

    async def wait(self) -> None:
        await anyio.to_thread.run_sync(self.event.wait, 60)

    def set(self) -> None:
        self.event.set()


def _hold(served: Served) -> Any:
    """Hold every /orders effect until the returned gate is set."""
    gate: Any = threading.Event() if served.kind.startswith("sync") else ThreadGate()
    served.app.state.gate = gate
    return gate


@pytest.fixture(params=KINDS)
def scoped(request: pytest.FixtureRequest) -> Iterator[Served]:
    url = request.getfixturevalue("sqlite_url" if request.param == "sync-sqlite" else "pg_url")
    with serve(request.param, url, middleware={"key_scope": _tenant}) as made:
        yield made


async def test_a_key_belongs_to_its_caller(scoped: Served) -> None:
    """Scenario 6: with ``key_scope``, tenant B's request under tenant A's key is B's own: B neither gets
    A's stored answer nor a 422 that tells it the key exists, and B using a key first does not block A."""
    async with httpx.AsyncClient(timeout=30) as client:
        first = await _post(client, scoped, "shared", 1, tenant="a")
        assert first.status_code == 201 and "idempotent-replayed" not in first.headers
        same_body = await _post(client, scoped, "shared", 1, tenant="b")
        assert same_body.status_code == 201 and "idempotent-replayed" not in same_body.headers
        other_key = await _post(client, scoped, "b-first", 2, tenant="b", amount=99)
        assert other_key.status_code == 201
        a_after_b = await _post(client, scoped, "b-first", 2, tenant="a")
        assert a_after_b.status_code == 201 and "idempotent-replayed" not in a_after_b.headers
        again = await _post(client, scoped, "shared", 1, tenant="a")
        assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
        conflict = await _post(client, scoped, "shared", 1, tenant="b", amount=5)
        assert conflict.status_code == 422  # B's own record: B's key, B's conflict
    assert scoped.count(orders, 1) == 2 and scoped.count(orders, 2) == 2


async def test_a_422_names_the_first_requests_fingerprint_and_first_seen_time(served: Served) -> None:
    """Scenario 7: the 422 problem names what the key conflicts with (the first request's fingerprint and
    when the key was first seen, on the database clock), never the first request's body."""
    first_body = json.dumps({"order_id": 3, "amount": 10}).encode()
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await _post(client, served, "reused", 3)).status_code == 201
        conflict = await _post(client, served, "reused", 3, amount=11)
    assert conflict.status_code == 422
    problem = conflict.json()
    expected = fingerprint_request(RequestParts("POST", "/orders", b"", [], first_body))
    assert problem["first_request_fingerprint"] == expected
    with served.engine.connect() as conn:
        created = conn.execute(sa.select(inbox_table.c.created_at)).scalar_one()
    assert problem["first_seen_at"] == iso_utc(created)
    assert problem["first_seen_at"].endswith("Z")
    assert expected in problem["detail"] and '"amount": 10' not in conflict.text


@pytest.mark.parametrize("kind", ["sync-postgresql", "async-psycopg"])
async def test_an_in_flight_duplicate_can_wait_for_the_first_answer(kind: str, pg_url: str) -> None:
    """Scenario 8: with ``wait_in_flight_ms``, a duplicate that arrives while the first request runs
    waits for it and gets its answer replayed instead of 409; past the wait it still gets 409."""
    with serve(kind, pg_url, middleware={"wait_in_flight_ms": 30_000}) as served:
        gate = _hold(served)
        async with httpx.AsyncClient(timeout=60) as client, anyio.create_task_group() as group:
            answers: dict[str, httpx.Response] = {}

            async def post(name: str) -> None:
                answers[name] = await _post(client, served, "waited", 4)

            group.start_soon(post, "first")
            await _until(lambda: served.count(orders) == 0 and served.seen.arrived == 1)
            group.start_soon(post, "duplicate")
            await _until(lambda: served.seen.arrived == 2)
            await anyio.sleep(0.3)  # let the duplicate find the key in flight (a wait, not an assertion)
            gate.set()
        assert answers["first"].status_code == 201 and "idempotent-replayed" not in answers["first"].headers
        assert answers["duplicate"].status_code == 201
        assert answers["duplicate"].headers["idempotent-replayed"] == "true"
        assert served.count(orders, 4) == 1
    with serve(kind, pg_url, middleware={"wait_in_flight_ms": 200}) as served:
        gate = _hold(served)
        async with httpx.AsyncClient(timeout=60) as client, anyio.create_task_group() as group:
            group.start_soon(_post, client, served, "bounded", 5)
            await _until(lambda: served.seen.arrived == 1)
            await anyio.sleep(0.3)
            refused = await _post(client, served, "bounded", 5)
            gate.set()
        assert refused.status_code == 409 and int(refused.headers["retry-after"]) >= 1


@pytest.mark.parametrize("kind", ["sync-postgresql", "async-psycopg"])
async def test_only_the_request_that_took_a_key_ends_it(kind: str, pg_url: str) -> None:
    """Scenario 9: a slow first request keeps its key against every retry, whatever the retry sends:
    the in-flight mark is the first transaction's own advisory lock, which only its commit, rollback or
    lost session ends (its "token" is the transaction itself). The first request's answer is the one
    stored. This held on main already: it guards the property rather than a defect."""
    with serve(kind, pg_url) as served:
        gate = _hold(served)
        async with httpx.AsyncClient(timeout=60) as client, anyio.create_task_group() as group:
            answers: list[httpx.Response] = []

            async def first() -> None:
                answers.append(await _post(client, served, "slow", 6))

            group.start_soon(first)
            await _until(lambda: served.seen.arrived == 1)
            await anyio.sleep(0.3)
            retries = [await _post(client, served, "slow", 6, amount=amount) for amount in (10, 11, 10)]
            assert [r.status_code for r in retries] == [409, 409, 409]
            gate.set()
        assert answers[0].status_code == 201
        replay = await _post_new(served, "slow", 6)
        assert replay.headers["idempotent-replayed"] == "true" and replay.content == answers[0].content
        assert served.count(orders, 6) == 1


async def _post_new(served: Served, key: str, order_id: int) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await _post(client, served, key, order_id)
