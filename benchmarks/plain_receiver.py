"""The HTTP floor: the least a receiver can do per delivery, to measure senders and receivers against.

A plain Starlette app on the same uvicorn as the reference receiver (h11 by default, no access log): each
POST does exactly one ``INSERT INTO plain_effect(key) VALUES (%s) ON CONFLICT DO NOTHING`` keyed by the
``Idempotency-Key`` header, on an autocommit connection of a psycopg async pool, and answers ``200`` with a
two-byte body. It runs in its own process so it never shares a GIL with the code being measured.

    .venv/bin/python benchmarks/plain_receiver.py --pg postgresql://postgres@127.0.0.1:5432/DB [--port 8099]

From Python::

    base_url, stop = start_plain_receiver("postgresql://postgres@127.0.0.1:5432/DB")
    ...  # POST base_url + "/anything" with an Idempotency-Key header
    stop()
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import queue
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import IO

import psycopg
import uvicorn
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from dagster_joblease.receiver.server import listening_socket

READY_PREFIX = "plain receiver listening on "
READY_TIMEOUT_S = 20.0
CREATE_SQL = "CREATE TABLE IF NOT EXISTS plain_effect (key text PRIMARY KEY)"
INSERT_SQL = "INSERT INTO plain_effect(key) VALUES (%s) ON CONFLICT DO NOTHING"


def libpq_conninfo(url: str) -> str:
    """Accept a SQLAlchemy ``postgresql+psycopg://`` URL as well as a libpq URL or key=value string."""
    if url.startswith("postgresql+"):
        return "postgresql://" + url.split("://", 1)[1]
    return url


def build_app(conninfo: str, max_connections: int = 64) -> Starlette:
    """The floor as a Starlette app (its pool opens and closes with the app's lifespan)."""
    pool = AsyncConnectionPool(
        conninfo, kwargs={"autocommit": True}, min_size=1, max_size=max_connections, open=False
    )

    async def effect(request: Request) -> Response:
        await request.body()
        key = request.headers.get("idempotency-key")
        if not key:
            return PlainTextResponse("missing Idempotency-Key\n", 400)
        async with pool.connection() as conn:
            await conn.execute(INSERT_SQL, (key,))
        return PlainTextResponse("ok")

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await pool.open()
        yield
        await pool.close()

    return Starlette(
        routes=[Route("/health", health, methods=["GET"]), Route("/{topic:path}", effect, methods=["POST"])],
        lifespan=lifespan,
    )


def serve(pg_conninfo: str, host: str = "127.0.0.1", port: int = 0, http: str = "h11") -> None:
    """Create the table if missing, print the ready line with the base URL, and serve until killed."""
    conninfo = libpq_conninfo(pg_conninfo)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(CREATE_SQL)
    sock = listening_socket(host, port)  # the receiver's: TCP_NODELAY on accepted connections
    config = uvicorn.Config(
        build_app(conninfo), http=http, lifespan="on", log_config=None, access_log=False, limit_concurrency=64
    )
    server = uvicorn.Server(config)
    bound_host, bound_port = sock.getsockname()[:2]

    async def main() -> None:
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        print(f"{READY_PREFIX}http://{bound_host!s}:{bound_port}", flush=True)
        await serving

    asyncio.run(main())


def _read_ready(stream: IO[str], out: queue.Queue[str]) -> None:
    for line in stream:
        out.put(line)
        if line.startswith(READY_PREFIX):
            break


def start_plain_receiver(pg_conninfo: str) -> tuple[str, Callable[[], None]]:
    """Start the floor receiver in a subprocess on a free port; return its base URL and a stop function."""
    base_url, stop, _pid = start_plain_receiver_process(pg_conninfo)
    return base_url, stop


def start_plain_receiver_process(pg_conninfo: str) -> tuple[str, Callable[[], None], int]:
    """:func:`start_plain_receiver`, and the receiver's process id (to read the CPU it used)."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--pg", pg_conninfo, "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_ready, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    while True:
        try:
            line = lines.get(timeout=READY_TIMEOUT_S)
        except queue.Empty:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"plain receiver did not start within {READY_TIMEOUT_S} s: {seen!r}") from None
        seen.append(line)
        if line.startswith(READY_PREFIX):
            base_url = line[len(READY_PREFIX) :].strip()
            break

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    return base_url, stop, proc.pid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg", required=True, help="PostgreSQL URL or conninfo of the database to write to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--http", default="h11", choices=["h11", "httptools"], help="uvicorn's HTTP parser")
    args = parser.parse_args()
    try:
        serve(args.pg, args.host, args.port, args.http)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
