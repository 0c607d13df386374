"""Where the client's time goes: CPU per call of the claim, the refusal and the enqueue, beside the floors.

    .venv/bin/python benchmarks/client.py [--calls 2000] [--rounds 5] [--profile claim|refused|enqueue|...]

CPU, not wall time: ``time.thread_time()`` around each call (this thread's user + system CPU, so a busy
machine's waiting is left out, unlike a throughput figure), the median per call, in rounds that rotate
the sides; min-max over rounds beside it. Sides, each on one connection in this process:

* ``identity``: ``JobIdentity.schedule(code, run_key)`` alone (validation, NFC, JSON, SHA-256);
* ``claim`` floors (physical, same-table) and ``library claim`` (``try_acquire`` with the identity built
  in the call), likewise for ``refused`` (a key held by a live lease);
* ``enqueue`` floors (physical, same-table: ``json.dumps`` and, same-table, SHA-256 per row; commit) and
  the library's ``enqueue_once`` on a psycopg connection and inside ``engine.begin()``.

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import dispatch, lease
from benchmarks.harness import Stat, load
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.storage import create_engine


def sides(url: str) -> dict[str, Callable[[int], object]]:
    """Each side as ``step(i)`` on its own connection (opened here, closed with the process)."""
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
    steps["claim library"] = lambda i: service.try_acquire(JobIdentity.schedule("bench", f"{tag}-lib-{i}"))
    steps["refused library"] = lambda i: service.try_acquire(
        JobIdentity.schedule("bench-held", f"key-{i % lease.HELD_KEYS}")
    )
    for kind in ("physical", "same-table", "psycopg", "library"):
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
    args = parser.parse_args(argv)
    (url,), drop = lease.databases(lease.server_url(), 1)
    try:
        lease.prepare(url)
        dispatch.prepare(url)
        lease.reset(url)
        steps = sides(url)
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
            if name.endswith("library") or name.endswith("psycopg"):
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
        for name in args.profile:
            profile(name, steps[name], offset, args.calls * 3, args.top)
            offset += args.calls * 3
    finally:
        drop()
    return 0


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
