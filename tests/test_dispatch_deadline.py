"""A request never outlives its claim, through a caller's ``httpx.Client`` too (issue 36, scenario 5):
real PostgreSQL, two dispatchers, a downstream slow twice (to its headers, then to its body) that records
when each request started and when it ended (its answer written, or the client gone). Nothing measures
time: the assertion is that no two requests of one ordering key were open at once."""

from __future__ import annotations

import itertools
import select
import socket
import threading
import time

import httpx
import sqlalchemy as sa

from dagster_joblease import outbox
from dagster_joblease.dispatch.dispatcher import Dispatcher
from dagster_joblease.dispatch.routes import Route
from tests.conftest import wait_until
from tests.dispatch_workers import status_counts


class SlowTwice:
    """A downstream whose first request waits ``pause_s`` before its headers and ``pause_s`` again before
    its body; every other request is answered at once. Each connection carries one request."""

    def __init__(self, pause_s: float) -> None:
        self.pause_s = pause_s
        self.lock = threading.Lock()
        #: (start, end, Idempotency-Key) of every request: end is when its answer was written or the
        #: client closed the connection, whichever came first.
        self.spans: list[tuple[float, float, str]] = []
        self.requests = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/slow"
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            start = time.time()
            raw_head, _, body = data.partition(b"\r\n\r\n")
            head = raw_head.decode("latin-1").split("\r\n")
            fields = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
            while len(body) < int(fields.get("content-length", "0")):
                body += conn.recv(65536)
            with self.lock:
                self.requests += 1
                slow = self.requests == 1
            end = self._answer(conn, slow)
            with self.lock:
                self.spans.append((start, end, fields.get("idempotency-key", "")))

    def _answer(self, conn: socket.socket, slow: bool) -> float:
        """Answer 200 (slowly: pauses before the headers and before the body); when the answer was
        written or the client went away."""
        try:
            if slow and self._client_gone(conn, self.pause_s):
                return time.time()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n")
            if slow and self._client_gone(conn, self.pause_s):
                return time.time()
            conn.sendall(b"ok")
        except OSError:
            pass
        return time.time()

    @staticmethod
    def _client_gone(conn: socket.socket, wait_s: float) -> bool:
        """Wait ``wait_s``; True as soon as the client closes the connection."""
        until = time.monotonic() + wait_s
        while (left := until - time.monotonic()) > 0:
            readable, _, _ = select.select([conn], [], [], left)
            if not readable:
                return False
            try:
                if conn.recv(65536) == b"":
                    return True
            except OSError:
                return True
        return False

    def close(self) -> None:
        self.stopped = True
        self.listener.close()


def test_a_callers_client_cannot_keep_a_request_open_past_its_claim(pg_engine: sa.Engine) -> None:
    """Scenario 5: 0.9 s to the headers and 0.9 s to the body kept a 1 s-timeout request open 1.8 s, past
    its 1.5 s claim, through a caller's client (each phase had the route's whole timeout); another
    dispatcher resent k/000 and then sent k/001 while the first request was open. The deadline caps each
    phase, the body's reads included: the request ends by its deadline, and its grace keeps the row
    in flight until the downstream is done with it."""
    with pg_engine.begin() as conn:
        outbox.enqueue_many(conn, [outbox.OutboxItem(f"k/{i:03d}", "slow", {"i": i}, "k") for i in range(2)])
    server = SlowTwice(0.9)
    stop = threading.Event()
    route = Route(server.url, timeout_s=1.0)
    try:
        with (
            httpx.Client() as client,
            Dispatcher(
                pg_engine, {"slow": route}, claim_ms=1_500, client=client, backoff_base_ms=10
            ) as first,
            Dispatcher(pg_engine, {"slow": route}, claim_ms=1_500, backoff_base_ms=10) as second,
        ):
            # The caller's client sends k/000 first; the other dispatcher polls meanwhile.
            sending = threading.Thread(target=first.dispatch)
            sending.start()
            wait_until(lambda: server.requests == 1, timeout=30)
            other = threading.Thread(target=second.run, kwargs={"poll_interval_s": 0.02, "stop": stop})
            other.start()
            try:
                sending.join(30)
                wait_until(
                    lambda: first.dispatch() is not None and status_counts(pg_engine) == {"SENT": 2},
                    timeout=60,
                    interval=0.02,
                )
            finally:
                stop.set()
                other.join(30)
    finally:
        server.close()
    with server.lock:
        spans = sorted(server.spans)
    for (_, open_until, key), (start, _, later) in itertools.pairwise(spans):
        assert start >= open_until, f"{later} started while {key}'s request was open: {spans}"
