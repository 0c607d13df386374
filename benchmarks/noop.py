"""The dispatcher's own cost alone (issue 36): the no-op transport figure of ``benchmarks/dispatch.py``.

    .venv/bin/python benchmarks/noop.py [--rounds 5] [--seconds 1] [--processes 1,4] [--long]
    .venv/bin/python benchmarks/noop.py --profile 50   # cProfile of 50 batches in this process, no figure
    .venv/bin/python benchmarks/noop.py --cpu 200      # 200 batches timed in this process: rows/s, CPU us/row

``Dispatcher.dispatch(limit=100)`` at concurrency 1 over a transport that answers every send at once
(``benchmarks.dispatch.NoopTransport``) vs the bare psycopg loop doing the same statements (claim 100 with
``FOR UPDATE SKIP LOCKED``, mark the 100 SENT in one statement), rotated rounds in one run, rows/s in 1 and
4 processes and their ratio; CPU µs per row of the client process beside it. ``--profile N`` fills rows and
profiles N batches of the dispatcher side in one process (the per-row cost, sorted by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dispatch import NOOP_FILL, _fill_pending, _truncate, noop_figures, noop_side, prepare
from benchmarks.harness import print_figures
from benchmarks.lease import add_arguments, databases, server_url


def profile(url: str, batches: int) -> None:
    """cProfile ``batches`` batches of the dispatcher side (after two warm ones), by own time."""
    _truncate(url)
    _fill_pending(url, (batches + 2) * 100, "v2:profile-")
    step, close = noop_side("library", url)()
    step(0)
    step(1)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for i in range(batches):
        step(i + 2)
    profiler.disable()
    wall = time.perf_counter() - started
    close()
    print(f"{batches} batches of 100 rows under cProfile: {wall / batches / 100 * 1e6:.1f} us/row (profiled)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


def cpu(url: str, batches: int) -> None:
    """Time ``batches`` batches of the dispatcher side in this process (after two warm ones): rows/s and
    CPU µs per row (this process's, every thread), printed on one line (for a before/after comparison
    that alternates two source trees)."""
    _truncate(url)
    _fill_pending(url, (batches + 2) * 100, "v2:cpu-")
    step, close = noop_side("library", url)()
    step(0)
    step(1)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i in range(batches):
        step(i + 2)
    wall, used = time.perf_counter() - wall0, time.process_time() - cpu0
    close()
    rows = batches * 100
    print(f"rows/s {rows / wall:.0f} cpu_us/row {used / rows * 1e6:.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    parser.add_argument("--profile", type=int, default=0, help="profile this many batches instead")
    parser.add_argument("--cpu", type=int, default=0, help="time this many batches in this process instead")
    args = parser.parse_args(argv)
    if args.long:
        args.seconds, args.rounds = max(args.seconds, 5.0), max(args.rounds, 7)
    started = time.perf_counter()
    urls, drop = databases(server_url(), 1)
    try:
        prepare(urls[0])
        if args.profile:
            profile(urls[0], args.profile)
            return 0
        if args.cpu:
            cpu(urls[0], args.cpu)
            return 0
        processes = [int(x) for x in args.processes.split(",")]
        figures = noop_figures(urls[0], args.rounds, args.seconds, processes)
    finally:
        drop()
    print(f"(each window fills {NOOP_FILL:,} due rows first)")
    print_figures("the dispatcher's own cost: no-op transport", figures, args.rounds, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
