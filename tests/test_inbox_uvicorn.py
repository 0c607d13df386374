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
from dagster_joblease.inbox.asgi import ASGIApp, Receive, Scope, Send, inbox_connection
from dagster_joblease.inbox.sync import Inbox
from dagster_joblease.receiver.server import listening_socket
from dagster_joblease.storage.engine import create_engine
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
    kind: str, url: str, engine: sa.Engine | None = None, *, tables: bool = True, **options: Any
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
                app = build_app(inbox)
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
    client: httpx.AsyncClient, served: Served, key: str, order_id: int, path: str = "/orders"
) -> httpx.Response:
    return await client.post(
        served.url + path,
        content=_order(order_id),
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
    )


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
