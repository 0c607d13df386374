"""A FastAPI shop that mounts InboxMiddleware: what a consumer writes (tests/test_inbox_asgi.py runs it).

``POST /orders`` writes one ``shop_order`` row through the inbox's transaction and answers 201 with a
``Location``; the same app is built on a sync :class:`Inbox` (sync endpoints, run in FastAPI's thread pool)
or an :class:`AsyncInbox` (async endpoints). ``app.state.gate`` (when set) is awaited / waited for inside
the effect, so a test can hold a key in flight; ``?answer=NNN`` makes the effect answer NNN; ``?boom=1``
makes it raise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Annotated, Any

import anyio
import psycopg
import sqlalchemy as sa
from fastapi import Depends, FastAPI, Request, Response
from pydantic import BaseModel

from dagster_joblease.inbox import AsyncInbox, Inbox, InboxMiddleware, inbox_connection

shop_metadata = sa.MetaData()
orders = sa.Table(
    "shop_order",
    shop_metadata,
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.Integer(), nullable=False),
    sa.Column("amount", sa.Integer(), nullable=False),
)


class Order(BaseModel):
    order_id: int
    amount: int


def _answer(order: Order, status: int, response: Response) -> dict[str, Any]:
    response.status_code = status
    response.headers["Location"] = f"/orders/{order.order_id}"
    response.headers["X-Not-Stored"] = "first time only"
    return {"order_id": order.order_id, "amount": order.amount}


def transaction(request: Request) -> Any:
    """The FastAPI dependency: the inbox's transaction (module level, so string annotations resolve)."""
    return inbox_connection(request)


def build_sync_app(inbox: Inbox, **options: Any) -> FastAPI:
    """The shop on a sync Inbox: the effect is written on the inbox's SQLAlchemy Connection."""
    app = FastAPI()
    app.state.gate = None
    app.add_middleware(InboxMiddleware, inbox=inbox, paths=["/orders", "/orders/*"], **options)

    @app.post("/orders")
    def create(
        order: Order,
        response: Response,
        conn: Annotated[sa.Connection, Depends(transaction)],
        answer: int = 201,
        boom: int = 0,
    ) -> dict[str, Any]:
        conn.execute(orders.insert().values(order_id=order.order_id, amount=order.amount))
        gate: threading.Event | None = app.state.gate
        if gate is not None:
            assert gate.wait(30)
        if boom:
            raise RuntimeError("the effect failed")
        return _answer(order, answer, response)

    @app.get("/orders/{order_id}")
    def show(order_id: int) -> dict[str, Any]:
        return {"order_id": order_id}

    return app


def build_async_app(inbox: AsyncInbox[Any], **options: Any) -> FastAPI:
    """The shop on an AsyncInbox: the effect is written on its SQLAlchemy or psycopg AsyncConnection."""
    app = FastAPI()
    app.state.gate = None
    app.add_middleware(InboxMiddleware, inbox=inbox, paths=["/orders", "/orders/*"], **options)

    @app.post("/orders")
    async def create(
        order: Order,
        response: Response,
        conn: Annotated[Any, Depends(transaction)],
        answer: int = 201,
        boom: int = 0,
    ) -> dict[str, Any]:
        if isinstance(conn, psycopg.AsyncConnection):
            await conn.execute(
                "INSERT INTO shop_order (order_id, amount) VALUES (%s, %s)", (order.order_id, order.amount)
            )
        else:
            await conn.execute(orders.insert().values(order_id=order.order_id, amount=order.amount))
        gate: anyio.Event | None = app.state.gate
        if gate is not None:
            await gate.wait()
        if boom:
            raise RuntimeError("the effect failed")
        return _answer(order, answer, response)

    @app.get("/orders/{order_id}")
    async def show(order_id: int) -> dict[str, Any]:
        return {"order_id": order_id}

    return app


#: Builds the app for an inbox of either kind.
def build_app(inbox: Inbox | AsyncInbox[Any], **options: Any) -> FastAPI:
    builder: Callable[..., FastAPI] = build_sync_app if isinstance(inbox, Inbox) else build_async_app
    return builder(inbox, **options)
