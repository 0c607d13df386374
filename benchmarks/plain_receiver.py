"""The HTTP floor: the least a receiver can do per delivery, to measure senders and receivers against.

Each POST does exactly one ``INSERT INTO plain_effect(key) VALUES (%s) ON CONFLICT DO NOTHING`` (psycopg 3,
autocommit, a prepared statement, one connection per server thread) keyed by the ``Idempotency-Key`` header,
and answers ``200`` with a two-byte body. HTTP/1.1 keep-alive, Nagle disabled, no logging. It runs in its own
process so it never shares a GIL with the code being measured.

    .venv/bin/python benchmarks/plain_receiver.py --pg postgresql://postgres@127.0.0.1:5432/DB [--port 8099]

From Python::

    base_url, stop = start_plain_receiver("postgresql://postgres@127.0.0.1:5432/DB")
    ...  # POST base_url + "/anything" with an Idempotency-Key header
    stop()
"""

from __future__ import annotations

import argparse
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO

import psycopg

READY_PREFIX = "plain receiver listening on "
READY_TIMEOUT_S = 20.0
CREATE_SQL = "CREATE TABLE IF NOT EXISTS plain_effect (key text PRIMARY KEY)"
INSERT_SQL = "INSERT INTO plain_effect(key) VALUES (%s) ON CONFLICT DO NOTHING"

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
_MISSING_KEY = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 24\r\n\r\n"
    b"missing Idempotency-Key\n"
)


def libpq_conninfo(url: str) -> str:
    """Accept a SQLAlchemy ``postgresql+psycopg://`` URL as well as a libpq URL or key=value string."""
    if url.startswith("postgresql+"):
        return "postgresql://" + url.split("://", 1)[1]
    return url


class _Handler(BaseHTTPRequestHandler):
    """One instance per TCP connection (one server thread), so the database connection lives per thread."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _PlainServer

    def setup(self) -> None:
        super().setup()
        self.db = psycopg.connect(self.server.conninfo, autocommit=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.db.close()

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        key = self.headers.get("Idempotency-Key")
        if not key:
            self.wfile.write(_MISSING_KEY)
            return
        self.db.execute(INSERT_SQL, (key,), prepare=True)
        self.wfile.write(_OK)

    def do_GET(self) -> None:
        self.wfile.write(_OK)

    def log_message(self, format: str, *args: object) -> None:
        """Silent: logging every request would be most of the floor's cost."""


class _PlainServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], conninfo: str) -> None:
        self.conninfo = conninfo
        super().__init__(address, _Handler)


def serve(pg_conninfo: str, host: str = "127.0.0.1", port: int = 0) -> None:
    """Create the table if missing, print the ready line with the base URL, and serve until killed."""
    conninfo = libpq_conninfo(pg_conninfo)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(CREATE_SQL)
    server = _PlainServer((host, port), conninfo)
    bound_host, bound_port = server.server_address[:2]
    print(f"{READY_PREFIX}http://{bound_host!s}:{bound_port}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


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
    args = parser.parse_args()
    try:
        serve(args.pg, args.host, args.port)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
