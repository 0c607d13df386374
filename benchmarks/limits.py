"""Global delivery limits measured against a recording downstream: max_in_flight, rate, a Retry-After pause,
and what the feature costs the unlimited path.

    .venv/bin/python benchmarks/limits.py [--rows-scale 1.0] [--rounds 7]

The PostgreSQL server comes from ``JOBLEASE_BENCH_PG_URL`` (default ``postgresql+psycopg://postgres@
127.0.0.1:5432/postgres``); the script creates a scratch database and drops it at the end. Everything
listens on loopback. The receiver (a thread pool HTTP server in this process) answers every POST after 50 ms
and records each request's arrival, its path and how many requests were in flight at that moment.

* ``max_in_flight``: 3 dispatcher processes at concurrency 8, one route with ``max_in_flight=4``. Printed:
  the most requests ever in flight at the receiver (goal: <= 4 in every sample) and the throughput against
  what the cap allows, ``4 / 50 ms`` = 80/s (goal >= 0.9).
* ``rate``: the same three processes, ``rate=200``. Printed: the most requests in any 1-second window
  (sliding, goal <= 200), and the mean of the whole 1-second buckets (goal >= 0.9 of 200).
* ``pause``: two routes in two limit groups, ``max_in_flight=4`` each; route A answers its 100th request
  with ``429 Retry-After: 2``. Printed: the time from that answer to the next request on A from any
  dispatcher (goal >= 2 s), and route B's throughput in the 2 s before vs during the pause (goal: unchanged).
* ``overhead``: one process at concurrency 8, no limits, a receiver answering at once, rounds alternating
  the dispatcher as shipped with the same dispatcher not reading the limit groups' state (a subclass here,
  ``_NoGroupState``, that skips that read and the pause re-reads): what the feature costs a route without
  limits (goal <= 5%). The columns the
  claim now writes (first attempt, claim group) are on both sides. Each round is a pair; the overhead is
  the median of the pairs' slowdowns (min-max beside it), in rows/s over the dispatch loop alone and in the
  dispatcher's CPU per row, which the disk's commit latency hardly moves.

Bounded: every loop ends when its rows are delivered or after a deadline. The machine may be shared and
loaded: the figures are noisy, say so when quoting them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dagster_joblease import outbox
from dagster_joblease.dispatch import Dispatcher, Route
from dagster_joblease.storage import create_engine, migrate

PG_ENV = "JOBLEASE_BENCH_PG_URL"
DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
LATENCY_S = 0.05
CTX = multiprocessing.get_context("spawn")


# -- the recording downstream ---------------------------------------------------------------------------


class Receiver:
    def __init__(self, latency_s: float, pause_path: str | None = None, pause_at: int = 0) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.arrivals: list[tuple[float, str]] = []
        #: (arrival, path, Idempotency-Key) of every request
        self.keyed: list[tuple[float, str, str]] = []
        self.counts: dict[str, int] = {}
        self.paused_answer_at: float | None = None
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                now = time.time()
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver.lock:
                    receiver.in_flight += 1
                    receiver.max_in_flight = max(receiver.max_in_flight, receiver.in_flight)
                    receiver.arrivals.append((now, self.path))
                    receiver.keyed.append((now, self.path, self.headers.get("Idempotency-Key", "")))
                    n = receiver.counts[self.path] = receiver.counts.get(self.path, 0) + 1
                if latency_s:
                    time.sleep(latency_s)
                status, extra = 200, {}
                if self.path == pause_path and n == pause_at:
                    status, extra = 429, {"Retry-After": "2"}
                with receiver.lock:
                    receiver.in_flight -= 1
                    if status == 429:
                        receiver.paused_answer_at = time.time()
                self.send_response(status)
                for k, v in extra.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.request_queue_size = 128
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def times(self, path: str | None = None) -> list[float]:
        with self.lock:
            return sorted(t for t, p in self.arrivals if path is None or p == path)


@contextmanager
def receiving(latency_s: float, **kw: Any) -> Iterator[Receiver]:
    receiver = Receiver(latency_s, **kw)
    thread = threading.Thread(target=receiver.httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.httpd.shutdown()
        receiver.httpd.server_close()
        thread.join(10)


# -- dispatcher processes -------------------------------------------------------------------------------


def _routes(spec: dict[str, dict[str, Any]]) -> dict[str, Route]:
    return {t: Route(r["url"], **{k: v for k, v in r.items() if k != "url"}) for t, r in spec.items()}


class _PauseTimed(Dispatcher):
    """The dispatcher as shipped, noting (time.time()) when each pause it writes at once has committed:
    the moment other dispatchers' claims can see it."""

    pause_committed: list[tuple[float, float]]

    def _write_pause_now(self, group: str, row: Any, decision: Any) -> None:
        learned = time.time()  # the 429 is judged; the write starts
        super()._write_pause_now(group, row, decision)
        self.pause_committed.append((learned, time.time()))


class _NoGroupState(_PauseTimed):
    """The overhead benchmark's baseline: the dispatcher without the limit groups' reads (a route without
    limits then behaves the same, minus what the feature costs it)."""

    def _read_states(self, conn: Any) -> dict[str, Any]:
        return {}

    def _refresh_pauses(self) -> None:
        pass


def drain(
    url: str,
    routes: dict[str, dict[str, Any]],
    deadline_s: float,
    group_state: bool = True,
    results: Any = None,
) -> None:
    """Dispatch until no row is pending or the deadline passes (a bounded loop); put the totals."""
    engine = create_engine(url)
    totals: dict[str, Any] = {"claimed": 0, "sent": 0, "released": 0, "retried": 0}
    kind = _PauseTimed if group_state else _NoGroupState
    dispatcher = kind(engine, _routes(routes), concurrency=8, backoff_base_ms=10, backoff_max_ms=100)
    dispatcher.pause_committed = []
    ends = time.monotonic() + deadline_s
    with dispatcher:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        while time.monotonic() < ends:
            report = dispatcher.dispatch(limit=100)
            for key in totals:
                totals[key] += getattr(report, key)
            if report.claimed == 0:
                if outbox.due_summary(engine).due == 0 and _pending(engine) == 0:
                    break
                time.sleep(0.01)
        # the loop alone: what the dispatcher spent delivering, without process start and import
        totals["loop_s"] = time.perf_counter() - wall0
        totals["loop_cpu_s"] = time.process_time() - cpu0
    engine.dispose()
    if dispatcher.pause_committed:
        totals["pause_committed"] = dispatcher.pause_committed
    if results is not None:
        results.put(totals)


def _pending(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM joblease_outbox WHERE status = 'PENDING'")
            ).scalar_one()
        )


def run_dispatchers(
    url: str, routes: dict[str, dict[str, Any]], count: int, deadline_s: float
) -> dict[str, Any]:
    """Run ``count`` dispatcher processes to the end; their summed totals (claimed, sent, released…)."""
    results = CTX.Queue()
    procs = [
        CTX.Process(target=drain, args=(url, routes, deadline_s, True, results), daemon=True)
        for _ in range(count)
    ]
    for p in procs:
        p.start()
    totals: dict[str, Any] = {}
    for _ in procs:
        for key, value in results.get(timeout=deadline_s + 60).items():
            totals[key] = totals.get(key, [] if isinstance(value, list) else 0) + value
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    return totals


def enqueue(engine: sa.Engine, topic: str, rows: int) -> None:
    with engine.begin() as conn:
        for i in range(rows):
            outbox.enqueue_once(
                conn, idempotency_key=f"v2:{topic}-{uuid.uuid4().hex}", topic=topic, payload={"v": 1, "n": i}
            )


def reset(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE joblease_outbox, joblease_route_group RESTART IDENTITY"))


# -- scenarios ------------------------------------------------------------------------------------------


def scenario_max_in_flight(url: str, engine: sa.Engine, rows: int) -> dict[str, Any]:
    reset(engine)
    enqueue(engine, "work", rows)
    with receiving(LATENCY_S) as rx:
        totals = run_dispatchers(url, {"work": {"url": rx.url + "/work", "max_in_flight": 4}}, 3, 120)
        times = rx.times()
        span = times[-1] - times[0] + LATENCY_S if times else float("nan")
        throughput = len(times) / span
        allowed = 4 / LATENCY_S
        return {
            "requests": len(times),
            "max_in_flight": rx.max_in_flight,
            "throughput_per_s": round(throughput, 1),
            "allowed_per_s": allowed,
            "ratio": round(throughput / allowed, 3),
            "dispatcher_totals": totals,
        }


def _sliding_max(times: list[float], window: float = 1.0) -> int:
    best, j = 0, 0
    for i, start in enumerate(times):
        while j < len(times) and times[j] < start + window:
            j += 1
        best = max(best, j - i)
    return best


def scenario_rate(url: str, engine: sa.Engine, rows: int) -> dict[str, Any]:
    reset(engine)
    enqueue(engine, "work", rows)
    with receiving(LATENCY_S) as rx:
        totals = run_dispatchers(url, {"work": {"url": rx.url + "/work", "rate": 200}}, 3, 120)
        times = rx.times()
    first = times[0]
    buckets: dict[int, int] = {}
    for t in times:
        buckets[int(t - first)] = buckets.get(int(t - first), 0) + 1
    whole = [buckets[s] for s in sorted(buckets)[:-1]]  # the last second is partial
    return {
        "requests": len(times),
        "max_in_any_1s_window": _sliding_max(times),
        "per_second_buckets": [buckets[s] for s in sorted(buckets)],
        "mean_whole_seconds": round(statistics.mean(whole), 1) if whole else None,
        "ratio_to_limit": round(statistics.mean(whole) / 200, 3) if whole else None,
        "dispatcher_totals (released: admissions given back, started too late)": totals,
    }


def _claimed_at(engine: sa.Engine, keys: list[str]) -> dict[str, float]:
    """Each key's first claim (``first_attempt_at``, the claim statement's database clock, as epoch
    seconds: the database and this process share the machine's clock)."""
    if not keys:
        return {}
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT idempotency_key, extract(epoch FROM first_attempt_at) FROM joblease_outbox "
                "WHERE idempotency_key IN :keys"
            ).bindparams(sa.bindparam("keys", expanding=True)),
            {"keys": keys},
        )
        return {k: float(t) for k, t in rows}


def scenario_pause(url: str, engine: sa.Engine, rows: int) -> dict[str, Any]:
    reset(engine)
    enqueue(engine, "a", rows)
    enqueue(engine, "b", rows)
    with receiving(LATENCY_S, pause_path="/a", pause_at=100) as rx:
        routes = {
            "a": {"url": rx.url + "/a", "limit_group": "A", "max_in_flight": 4},
            "b": {"url": rx.url + "/b", "limit_group": "B", "max_in_flight": 4},
        }
        totals = run_dispatchers(url, routes, 3, 120)
        answered = rx.paused_answer_at
        a_times, b_times = rx.times("/a"), rx.times("/b")
        with rx.lock:
            keyed = list(rx.keyed)
    if answered is None:
        return {"error": "route A never answered 429"}
    writes = totals.get("pause_committed", [])
    committed = min((c for _, c in writes), default=None)
    learned = min((learned for learned, _ in writes), default=None)
    after = [t for t in a_times if t > answered]
    gap = (after[0] - answered) if after else None
    before_b = sum(1 for t in b_times if answered - 2 <= t < answered) / 2
    during_b = sum(1 for t in b_times if answered <= t < answered + 2) / 2
    # The requests on A that started within the pause: when was each claimed, against the moment the pause
    # committed? Claimed before it: no dispatcher could have known (the downstream's answer was still on
    # its way, or being written). Claimed after it: a request the pause should have stopped.
    leaked = [(t, k) for t, p, k in keyed if p == "/a" and answered < t < answered + 2]
    claimed = _claimed_at(engine, [k for _, k in leaked])
    detail = [
        {
            "arrived_after_429_ms": round((t - answered) * 1000, 1),
            "claimed_vs_pause_commit_ms": None
            if committed is None or k not in claimed
            else round((claimed[k] - committed) * 1000, 1),
        }
        for t, k in sorted(leaked)
    ]
    return {
        "gap_429_to_next_a_request_s": None if gap is None else round(gap, 3),
        "a_requests_within_2s_after_429": len(leaked),
        "429_judged_by_dispatcher_after_answer_ms": None
        if learned is None
        else round((learned - answered) * 1000, 1),
        "pause_committed_after_answer_ms": None
        if committed is None
        else round((committed - answered) * 1000, 1),
        "of_those_claimed_before_the_pause_committed": sum(
            1
            for d in detail
            if d["claimed_vs_pause_commit_ms"] is not None and d["claimed_vs_pause_commit_ms"] < 0
        ),
        "of_those_claimed_after_the_pause_committed (must be 0)": sum(
            1
            for d in detail
            if d["claimed_vs_pause_commit_ms"] is None or d["claimed_vs_pause_commit_ms"] >= 0
        ),
        "a_requests_in_the_pause": detail,
        "b_per_s_2s_before": before_b,
        "b_per_s_during_pause": during_b,
        "b_ratio_during_vs_before": round(during_b / before_b, 3) if before_b else None,
    }


def _overhead_round(
    url: str, engine: sa.Engine, rows: int, group_state: bool, target: str
) -> tuple[float, float]:
    """One drain of ``rows`` rows: (rows/s, dispatcher CPU µs per row), both over the dispatch loop alone
    (process start and import are outside it)."""
    reset(engine)
    enqueue(engine, "work", rows)
    results = CTX.Queue()
    proc = CTX.Process(
        target=drain, args=(url, {"work": {"url": target}}, 120, group_state, results), daemon=True
    )
    proc.start()
    totals = results.get(timeout=300)
    proc.join(60)
    if totals["sent"] != rows:
        raise SystemExit(f"overhead round sent {totals['sent']} of {rows} rows")
    return rows / totals["loop_s"], totals["loop_cpu_s"] / rows * 1e6


def scenario_overhead(url: str, engine: sa.Engine, rows: int, rounds: int) -> dict[str, Any]:
    """The unlimited path with its group reads (pauses are on by default) against the same dispatcher
    without them, alternating in pairs; the overhead is the median of the per-pair ratios, in rows/s and
    in the dispatcher's CPU per row. On this kind of machine the disk's commit latency moves rows/s by a
    third between rounds; the pair shares it, and CPU per row hardly depends on it."""
    shipped: list[tuple[float, float]] = []
    without: list[tuple[float, float]] = []
    with receiving(0.0) as rx:
        target = rx.url + "/work"
        for r in range(rounds):
            order = [(True, shipped), (False, without)]
            if r % 2:
                order.reverse()
            for flag, sink in order:
                sink.append(_overhead_round(url, engine, rows, flag, target))
    slowdown = [1 - s[0] / w[0] for s, w in zip(shipped, without, strict=True)]
    cpu_ratios = [s[1] / w[1] for s, w in zip(shipped, without, strict=True)]
    return {
        "rows_per_round": rows,
        "shipped_rows_per_s": [round(x[0]) for x in shipped],
        "without_group_reads_rows_per_s": [round(x[0]) for x in without],
        "shipped_cpu_us_per_row": [round(x[1]) for x in shipped],
        "without_group_reads_cpu_us_per_row": [round(x[1]) for x in without],
        "overhead": round(statistics.median(slowdown), 3),
        "overhead_min_max": [round(min(slowdown), 3), round(max(slowdown), 3)],
        "cpu_overhead": round(statistics.median(cpu_ratios) - 1, 3),
        "cpu_overhead_min_max": [round(min(cpu_ratios) - 1, 3), round(max(cpu_ratios) - 1, 3)],
    }


# -- main -----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows-scale", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=7, help="overhead rounds (pairs)")
    args = parser.parse_args()
    admin = sa.engine.make_url(os.environ.get(PG_ENV, DEFAULT_PG))
    name = f"joblease_bench_limits_{uuid.uuid4().hex[:8]}"
    admin_engine = sa.create_engine(admin, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin_engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = admin.set(database=name).render_as_string(hide_password=False)
    engine = create_engine(url)
    try:
        migrate(engine)
        scale = args.rows_scale
        print(f"load average before: {os.getloadavg()}", flush=True)
        results = {
            "max_in_flight=4": scenario_max_in_flight(url, engine, int(400 * scale)),
            "rate=200": scenario_rate(url, engine, int(1200 * scale)),
            "pause (429 Retry-After: 2)": scenario_pause(url, engine, int(400 * scale)),
            "overhead (unlimited path)": scenario_overhead(url, engine, int(2000 * scale), args.rounds),
        }
        for title, figures in results.items():
            print(f"\n{title}")
            for key, value in figures.items():
                print(f"  {key}: {json.dumps(value)}")
        print(f"\nload average after: {os.getloadavg()}")
    finally:
        engine.dispose()
        with admin_engine.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin_engine.dispose()


if __name__ == "__main__":
    main()
