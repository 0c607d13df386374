"""Client CPU of a few library calls in several checkouts, alternating, beside each checkout's floor.

    .venv/bin/python benchmarks/checkouts.py DIR [DIR ...] [--reps 3] [--calls 500] [--rounds 3]
                                             [--only enqueue,claim,refused]

Each DIR is a checkout of this repository (``git worktree add --detach DIR <commit>``); one process per
checkout and repetition runs that checkout's own ``benchmarks/lease.py`` and ``benchmarks/dispatch.py``
sides (``claim``/``refused``: ``physical`` and ``library``; ``enqueue``: ``physical`` and ``psycopg``)
with that checkout's ``dagster_joblease``, in ``--rounds`` rotated rounds of ``--calls`` calls, and the
checkouts take turns ``--reps`` times. Per side: the median per-call thread CPU (``time.thread_time``) of
each round; per checkout, the library's CPU minus the physical floor's in the same round, median and
min-max over every round. Thread CPU leaves out the disk's commit latency, which moves between rounds
on a shared machine, so a regression in the client path shows even where throughput cannot say.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SIDES = {
    "claim": ("physical", "library"),
    "refused": ("physical", "library"),
    "enqueue": ("physical", "psycopg"),
}


def one(checkout: str, calls: int, rounds: int, only: list[str]) -> dict[str, list[float]]:
    """In this process, with ``checkout``'s code: per side, each round's median CPU µs per call."""
    sys.path.insert(0, checkout)
    import dagster_joblease
    from benchmarks import dispatch, lease

    assert str(Path(dagster_joblease.__file__).resolve()).startswith(checkout), dagster_joblease.__file__

    (url,), drop = lease.databases(lease.server_url(), 1)
    try:
        lease.prepare(url)
        dispatch.prepare(url)
        lease.reset(url)
        steps: dict[str, Any] = {}
        for workload in only:
            for side in SIDES[workload]:
                if workload == "enqueue":
                    steps[f"{workload} {side}"] = dispatch.enqueue_side(side, url)()[0]
                else:
                    steps[f"{workload} {side}"] = lease.SIDES[side](url, workload)()[0]
        names = list(steps)
        for name in names:
            for i in range(20):
                steps[name](10**9 + i)
        cpu: dict[str, list[float]] = {name: [] for name in names}
        offset = 0
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                spent = []
                for i in range(offset, offset + calls):
                    start = time.thread_time_ns()
                    steps[name](i)
                    spent.append(time.thread_time_ns() - start)
                offset += calls
                cpu[name].append(statistics.median(spent) / 1000)
        return cpu
    finally:
        drop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkouts", nargs="+", help="checkout directories, measured in turn")
    parser.add_argument("--reps", type=int, default=3, help="turns of every checkout (default 3)")
    parser.add_argument("--calls", type=int, default=500, help="calls per side per round (default 500)")
    parser.add_argument("--rounds", type=int, default=3, help="rotated rounds per process (default 3)")
    parser.add_argument("--only", default="enqueue,claim,refused", help="workloads (default all three)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one checkout
    args = parser.parse_args(argv)
    only = [w for w in args.only.split(",") if w]
    unknown = sorted(set(only) - set(SIDES))
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}: choose from {', '.join(SIDES)}")
    if args.one:
        print(json.dumps(one(str(Path(args.checkouts[0]).resolve()), args.calls, args.rounds, only)))
        return 0
    diffs: dict[str, dict[str, list[float]]] = {c: {w: [] for w in only} for c in args.checkouts}
    for _ in range(args.reps):
        for checkout in args.checkouts:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    checkout,
                    "--one",
                    f"--calls={args.calls}",
                    f"--rounds={args.rounds}",
                    f"--only={args.only}",
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            cpu = json.loads(out.strip().splitlines()[-1])
            for workload in only:
                floor, library = (cpu[f"{workload} {side}"] for side in SIDES[workload])
                diffs[checkout][workload] += [lib - flo for lib, flo in zip(library, floor, strict=True)]
    print(
        f"library minus physical floor, client CPU per call (us), median (min-max) of {args.reps} x "
        f"{args.rounds} rounds of {args.calls} calls"
    )
    for checkout in args.checkouts:
        cells = [
            f"{w} {statistics.median(d):+.1f} ({min(d):+.0f}..{max(d):+.0f})"
            for w, d in diffs[checkout].items()
        ]
        print(f"  {checkout}: " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
