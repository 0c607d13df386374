"""A downstream for the limit tests: answers after a fixed latency (or holds requests until released) and
records every request's arrival time, path, key and how many requests were in flight at each moment, and
each request's start and end (``spans``: a request ends when its answer is written, or when the client
went away)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: (path, request number on that path, starting at 1) → (status, headers)
Respond = Callable[[str, int], tuple[int, dict[str, str]]]


class LimitServer:
    def __init__(self, latency_s: float = 0.05, respond: Respond | None = None) -> None:
        self.latency_s = latency_s
        self.respond = respond
        #: (path, request number on that path) → seconds to hold it (default: latency_s)
        self.holds: Callable[[str, int], float] | None = None
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        #: (arrival time.time(), path, Idempotency-Key header, status answered)
        self.requests: list[tuple[float, str, str, int]] = []
        #: (start time.time(), end time.time(), path, Idempotency-Key header) of every finished request
        self.spans: list[tuple[float, float, str, str]] = []
        #: (start time.time(), time.time() right before its answer is written, path, Idempotency-Key
        #: header) of every request answered: no client can have seen that answer before the second time.
        self.answers: list[tuple[float, float, str, str]] = []
        self.per_path: dict[str, int] = {}
        self.hold = threading.Event()  # set: requests are held until release() (for the SIGKILL test)
        self.released = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                arrived = time.time()
                key = self.headers.get("Idempotency-Key", "")
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    number = server.per_path[self.path] = server.per_path.get(self.path, 0) + 1
                status, headers = server.respond(self.path, number) if server.respond else (200, {})
                try:
                    if server.hold.is_set():
                        server.released.wait(120)
                    else:
                        time.sleep(server.hold_s(self.path, number))
                    with server.lock:
                        server.requests.append(
                            (arrived, self.path, self.headers.get("Idempotency-Key", ""), status)
                        )
                        server.answers.append((arrived, time.time(), self.path, key))
                        server.in_flight -= 1
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                    self.wfile.flush()
                except OSError:
                    pass  # the client died (SIGKILL test)
                finally:
                    with server.lock:
                        server.spans.append((arrived, time.time(), self.path, key))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def hold_s(self, path: str, number: int) -> float:
        """How long to hold request ``number`` of ``path`` before answering (``latency_s`` unless
        ``holds`` says otherwise)."""
        return self.holds(path, number) if self.holds is not None else self.latency_s

    def most_at_once(self, path: str | None = None) -> int:
        """The most requests in progress at one moment, from their recorded starts and ends."""
        with self.lock:
            events = sorted(
                (t, step)
                for start, end, p, _ in self.spans
                if path is None or p == path
                for t, step in ((start, 1), (end, -1))
            )
        best = now = 0
        for _, step in events:  # an end and a start at the same instant: the end counts first
            now += step
            best = max(best, now)
        return best

    def arrivals(self, path: str | None = None) -> list[float]:
        with self.lock:
            return sorted(t for t, p, _, _ in self.requests if path is None or p == path)

    def max_in_window(self, path: str | None = None, window_s: float = 1.0) -> int:
        """The most requests that arrived in any half-open window of ``window_s`` seconds."""
        times = self.arrivals(path)
        best, j = 0, 0
        for i, start in enumerate(times):
            while j < len(times) and times[j] < start + window_s:
                j += 1
            best = max(best, j - i)
        return best


@contextmanager
def serve(latency_s: float = 0.05, respond: Respond | None = None) -> Iterator[LimitServer]:
    server = LimitServer(latency_s, respond)
    thread = threading.Thread(target=server.httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.released.set()
        server.httpd.shutdown()
        server.httpd.server_close()
        thread.join(10)
