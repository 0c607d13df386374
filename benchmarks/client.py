"""Where the client's time goes: CPU per call of the claim, the refusal and the enqueue, beside the floors.

    .venv/bin/python benchmarks/client.py [--calls 2000] [--rounds 5] [--profile claim|refused|enqueue|...]

CPU, not wall time: ``time.thread_time()`` around each call (this thread's user + system CPU, so a busy
machine's waiting is left out, unlike a throughput figure), the median per call, in rounds that rotate
the sides; min-max over rounds beside it. Sides, each on one connection in this process:

* ``identity``: ``JobIdentity.schedule(code, run_key)`` alone (validation, NFC, JSON, SHA-256);
* ``claim`` floors (physical, same-table), ``claim library-sql`` (the library's own compiled claim SQL and
  parameters, identity included, from a bare loop on the library's autocommit connection: the gap to
  ``claim library`` is the library's Python around the statement) and ``claim library`` (``try_acquire``
  with the identity built in the call), likewise for ``refused`` (a key held by a live lease);
  ``refused library first`` refuses keys the service has never met (held by another service), so its
  claim inserts first and then reads the status: two statements, where a repeat is one;
* ``enqueue`` floors (physical, same-table: ``json.dumps`` and, same-table, SHA-256 per row; commit),
  the library's ``enqueue_once`` on a psycopg connection and inside ``engine.begin()`` (``library``),
  and ``sqlalchemy``: the same-table INSERT on the driver inside ``engine.begin()``, i.e. SQLAlchemy's own
  begin and commit (``library`` minus ``sqlalchemy`` is what the library adds there); ``pooled``: the
  same-table loop on a connection held out of the engine's pool, outside any SQLAlchemy transaction
  (``sqlalchemy`` minus ``pooled`` is SQLAlchemy's checkout, begin, commit and check-in between real
  statements), and ``begin-only``: an empty ``with engine.begin():`` block in a tight loop (the same
  scaffolding with its code hot in the CPU caches: a lower bound).

``--profile NAME`` then runs that side under cProfile and prints the functions with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import dispatch, lease
from benchmarks.harness import Stat, load
from benchmarks.plain_receiver import start_plain_receiver_process
from dagster_joblease.dispatch import Dispatcher, Route
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.storage import create_engine
from dagster_joblease.storage import leases as store
from dagster_joblease.storage.autocommit import autocommit_connections


def sides(url: str, first_refusals: int) -> dict[str, Callable[[int], object]]:
    """Each side as ``step(i)`` on its own connection (opened here, closed with the process).

    ``first_refusals``: how many keys to hold for ``refused library first`` (each refused once).
    """
    tag = secrets.token_hex(4)
    steps: dict[str, Callable[[int], object]] = {
        "identity": lambda i: JobIdentity.schedule("bench", f"{tag}-id-{i}"),
    }
    for workload in ("claim", "refused"):
        for name, make in (("physical", lease.physical), ("same-table", lease.same_table)):
            step, _ = make(url, workload)()
            steps[f"{workload} {name}"] = step
    engine = create_engine(url)
    service = LeaseService(engine, lease_ms=lease.LEASE_MS)
    insert = store.INSERT_CLAIM
    handle = autocommit_connections(engine).acquire(engine)

    def library_sql(i: int) -> object:
        """The library's own claim SQL and parameters, from a bare loop on its own kind of connection."""
        job = JobIdentity.schedule("bench", f"{tag}-sql-{i}")
        params = {
            "p_lock_key": job.idempotency_key,
            "p_job_type": job.type.value,
            "p_code": job.code,
            "p_run_key": job.run_key,
            "p_owner_token": secrets.token_hex(16),
            "p_lease_ms": lease.LEASE_MS,
            "p_heartbeat_ms": 30_000,
            "p_holder": "bench",
        }
        handle.cursor.execute(insert.sql, insert.args(params), prepare=True)
        return handle.cursor.fetchone()

    steps["claim library-sql"] = library_sql
    steps["claim library"] = lambda i: service.try_acquire(JobIdentity.schedule("bench", f"{tag}-lib-{i}"))
    steps["refused library"] = lambda i: service.try_acquire(
        JobIdentity.schedule("bench-held", f"key-{i % lease.HELD_KEYS}")
    )
    # A key this service has never met: its claim inserts first, meets the row, then reads its status
    # (two statements; a repeat of the key is one, as in ``refused library``).
    holder = LeaseService(engine, lease_ms=lease.LEASE_MS)
    fresh = [JobIdentity.schedule("bench-first", f"{tag}-{n}") for n in range(first_refusals)]
    for job in fresh:
        holder.acquire(job)
    unmet = iter(fresh)
    steps["refused library first"] = lambda i: service.try_acquire(
        JobIdentity.schedule("bench-first", next(unmet).run_key or "")
    )
    for kind in ("physical", "same-table", "pooled", "psycopg", "library", "sqlalchemy", "begin-only"):
        step, _ = dispatch.enqueue_side(kind, url)()
        steps[f"enqueue {kind}"] = step
    return steps


def per_call_us(step: Callable[[int], object], start: int, calls: int) -> float:
    """Median thread CPU µs of ``calls`` calls."""
    clock = time.thread_time_ns
    samples = []
    for i in range(start, start + calls):
        t = clock()
        step(i)
        samples.append(clock() - t)
    return statistics.median(samples) / 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1_000, help="calls per side per round (default 1,000)")
    parser.add_argument("--rounds", type=int, default=5, help="rotated rounds (default 5)")
    parser.add_argument(
        "--profile", action="append", default=[], help="side(s) to profile, e.g. 'claim library'"
    )
    parser.add_argument("--top", type=int, default=18, help="profile lines to print")
    parser.add_argument(
        "--profile-delivery",
        type=int,
        default=0,
        metavar="ROWS",
        help="also profile the dispatcher (concurrency 1, inline) and the bare httpx loop over ROWS rows",
    )
    args = parser.parse_args(argv)
    (url,), drop = lease.databases(lease.server_url(), 1)
    try:
        lease.prepare(url)
        dispatch.prepare(url)
        lease.reset(url)
        steps = sides(url, first_refusals=20 + args.calls * (args.rounds + 3 * len(args.profile)))
        names = list(steps)
        got: dict[str, list[float]] = {n: [] for n in names}
        offset = 0
        for name in names:  # warm every connection and prepared statement
            for i in range(20):
                steps[name](10**9 + i)
        for r in range(args.rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                got[name].append(per_call_us(steps[name], offset, args.calls))
                offset += args.calls
        print(
            f"\nclient CPU per call (thread_time, median of each round; min-max over {args.rounds}); {load()}"
        )
        ident = statistics.median(got["identity"])
        width = max(map(len, names))
        for name in names:
            s = Stat.of(got[name])
            extra = ""
            workload = name.split()[0]
            if " library" in name or name.endswith("psycopg"):
                floor = statistics.median(got[f"{workload} physical"])
                target = floor + (ident if workload != "enqueue" else 0.0)
                extra = (
                    f"  = physical floor {floor:.0f} + {s.median - floor:.0f} us "
                    f"({s.median / target:.2f}x target)"
                )
            print(f"  {name.ljust(width)}  {s.median:6.0f} us ({s.low:.0f}-{s.high:.0f}){extra}")
        print(
            "  target: the physical floor's CPU, plus the identity's for a claim or refusal "
            f"(identity {ident:.0f} us)"
        )
        sqla, pooled, lib = (
            statistics.median(got[f"enqueue {k}"]) for k in ("sqlalchemy", "pooled", "library")
        )
        print(
            f"  SQLAlchemy's engine.begin() scaffolding between real statements: {sqla - pooled:.0f} us "
            f"(enqueue sqlalchemy - enqueue pooled; an empty block in a hot loop: "
            f"{statistics.median(got['enqueue begin-only']):.0f} us); the library inside it adds "
            f"{lib - sqla:.0f} us (library - sqlalchemy)"
        )
        for name in args.profile:
            profile(name, steps[name], offset, args.calls * 3, args.top)
            offset += args.calls * 3
        if args.profile_delivery:
            profile_delivery(url, args.profile_delivery, args.top)
    finally:
        drop()
    return 0


def profile_delivery(url: str, rows: int, top: int) -> None:
    """cProfile (thread CPU) of the dispatcher draining ``rows`` rows inline, then of the bare httpx loop
    posting as many to the same plain receiver."""
    base, stop, _pid = start_plain_receiver_process(url)
    target = base + "/bench"
    try:
        dispatch._truncate(url)  # the enqueue sides above left pending rows of their own
        dispatch._fill_pending(url, rows, "v2:prof-")
        engine = create_engine(url)
        with Dispatcher(engine, {"bench": Route(target)}, concurrency=1) as dispatcher:
            dispatcher.dispatch(limit=10)  # warm the client's connection and the statements
            prof = cProfile.Profile(time.thread_time)
            prof.enable()
            while dispatcher.dispatch(limit=100).claimed:
                pass
            prof.disable()
        engine.dispose()
        print(f"\nprofile of the dispatcher delivering {rows} rows inline (thread CPU; own time first):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)
        print("the dispatcher's own functions, by cumulative time:")
        pstats.Stats(prof).sort_stats("cumulative").print_stats("dagster_joblease", top)
        bodies = [dispatch._text(i).encode() for i in range(rows)]
        with httpx.Client() as client:
            client.post(target, content=b"{}", headers={"Idempotency-Key": "v2:prof-warm"})
            prof = cProfile.Profile(time.thread_time)
            prof.enable()
            for i, body in enumerate(bodies):
                client.post(
                    target,
                    content=body,
                    headers={"Content-Type": "application/json", "Idempotency-Key": f"v2:prof-floor-{i}"},
                ).raise_for_status()
            prof.disable()
        print(f"\nprofile of the bare httpx loop posting {rows} rows (thread CPU; own time first):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    finally:
        stop()


def profile(name: str, step: Callable[[int], object], start: int, calls: int, top: int) -> None:
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    for i in range(start, start + calls):
        step(i)
    prof.disable()
    print(f"\nprofile of {calls} x {name!r} (thread CPU; own time first):")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    sys.exit(main())
