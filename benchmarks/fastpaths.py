"""What each remaining fast path buys: its statement with the fast path on and off, in one process.

    .venv/bin/python benchmarks/fastpaths.py [--blocks 9] [--calls 150]

Each case runs ``--calls`` calls in a block; blocks rotate through every case ``--blocks`` times, so a
fast path and its absence meet the same machine within seconds. Per case: the median per-call thread CPU
(``time.thread_time``, what the client spends; a busy machine's waiting is left out) and wall time, each
the median of its blocks; for a case with a fast path off, the per-block difference in CPU from the same
statement with it on, and the ratio of their rates (on over off, per block, then the median).

The fast paths, and how each is turned off here (the code it stands for is unchanged):

* ``no-autocommit``: claims and refusals through ``engine.connect()`` in AUTOCOMMIT (SQLAlchemy's pool)
  instead of the library's own autocommit connections (``storage/autocommit.py`` behind
  ``storage.driver.statements``);
* ``no-hint``: a lease service that never remembers meeting a key's row (``lease.KNOWN_KEYS``), so a
  refusal inserts first, meets the row, then reads its status;
* ``fresh-cursors``: ``storage.driver.in_transaction`` with new cursors per call instead of the ones kept
  on the caller's psycopg connection (``enqueue_once`` on a psycopg connection and inside
  ``engine.begin()``);
* ``no-claim-memo``: the dispatcher's claim statement built per call instead of per shape
  (``storage.outbox._claim_template``), on an outbox with nothing due;
* ``no-mark-memo``: ``storage.outbox.mark_sent``'s statement built per call instead of per dialect.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import dispatch, lease
from benchmarks.harness import load
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.storage import create_engine, driver
from dagster_joblease.storage import outbox as ostore

Step = Callable[[int], object]


class _Forgetful(set[str]):
    """A lease service's memory of keys met that never remembers one (``no-hint``)."""

    def __contains__(self, key: object) -> bool:
        return False

    def add(self, key: str) -> None:
        pass


def _fresh_in_transaction(target: Any) -> Any:
    if target.driver is not None:
        return driver._Driver(target.driver, prepare=True)
    return driver._Alchemy(target.connection)


#: mode -> (module, attribute, what stands in for the fast path while it is off)
_OFF: dict[str, tuple[Any, str, Any]] = {
    "no-autocommit": (driver, "is_psycopg", lambda dialect: False),
    "fresh-cursors": (driver, "in_transaction", _fresh_in_transaction),
    "no-claim-memo": (ostore, "_claim_template", ostore._claim_update),
    "no-mark-memo": (ostore, "_mark_sent_statement", ostore._mark_sent_statement.__wrapped__),
}


@contextmanager
def turned_off(mode: str) -> Iterator[None]:
    """The fast path ``mode`` names turned off for the block (``normal``: every fast path on)."""
    if mode not in _OFF:
        yield
        return
    module, name, stand_in = _OFF[mode]
    kept = getattr(module, name)
    setattr(module, name, stand_in)
    try:
        yield
    finally:
        setattr(module, name, kept)


def cases(url: str) -> list[tuple[str, str, Step]]:
    """(figure, mode, step): each fast path's figure with it on (``normal``) and off, beside its floor."""
    engine = create_engine(url)
    service = LeaseService(engine, lease_ms=lease.LEASE_MS)
    forgetful = LeaseService(engine, lease_ms=lease.LEASE_MS)
    forgetful._known = _Forgetful()
    tag = uuid.uuid4().hex[:10]

    def claim(i: int) -> object:
        return service.try_acquire(JobIdentity.schedule("bench", f"{tag}-{i}"))

    def refused(of: LeaseService) -> Step:
        return lambda i: of.try_acquire(JobIdentity.schedule("bench-held", f"key-{i % lease.HELD_KEYS}"))

    def delivery_claim(i: int) -> object:
        with engine.begin() as conn:
            token = secrets.token_hex(8)
            return ostore.claim_due(conn, token=token, limit=100, claim_ms=30_000, topics=["nothing-due"])

    def mark(i: int) -> object:
        with engine.begin() as conn:
            return ostore.mark_sent(conn, [-1, -2], "none", 200)

    enqueue_pg = dispatch.enqueue_side("psycopg", url)()[0]
    enqueue_begin = dispatch.enqueue_side("library", url)()[0]
    return [
        ("claim, new key", "physical floor", lease.physical(url, "claim")()[0]),
        ("claim, new key", "normal", claim),
        ("claim, new key", "no-autocommit", claim),
        ("claim refused, key held", "physical floor", lease.physical(url, "refused")()[0]),
        ("claim refused, key held", "normal", refused(service)),
        ("claim refused, key held", "no-autocommit", refused(service)),
        ("claim refused, key held", "no-hint", refused(forgetful)),
        ("enqueue, psycopg connection", "physical floor", dispatch.enqueue_side("physical", url)()[0]),
        ("enqueue, psycopg connection", "normal", enqueue_pg),
        ("enqueue, psycopg connection", "fresh-cursors", enqueue_pg),
        ("enqueue, inside engine.begin()", "normal", enqueue_begin),
        ("enqueue, inside engine.begin()", "fresh-cursors", enqueue_begin),
        ("delivery claim, nothing due", "normal", delivery_claim),
        ("delivery claim, nothing due", "no-claim-memo", delivery_claim),
        ("mark_sent, no rows", "normal", mark),
        ("mark_sent, no rows", "no-mark-memo", mark),
    ]


def measure(
    all_cases: list[tuple[str, str, Step]], blocks: int, calls: int
) -> tuple[list[list[float]], list[list[float]]]:
    """Per case, per block: the median thread CPU and wall µs per call."""
    offset = 0
    for _, mode, step in all_cases:  # warm every connection, cursor and prepared statement
        with turned_off(mode):
            for i in range(20):
                step(10**9 + offset + i)
        offset += 20
    cpu: list[list[float]] = [[] for _ in all_cases]
    wall: list[list[float]] = [[] for _ in all_cases]
    order = list(range(len(all_cases)))
    for block in range(blocks):
        shift = block % len(order)
        for index in order[shift:] + order[:shift]:
            _, mode, step = all_cases[index]
            spent, took = [], []
            with turned_off(mode):
                for i in range(offset, offset + calls):
                    c, w = time.thread_time_ns(), time.perf_counter_ns()
                    step(i)
                    spent.append(time.thread_time_ns() - c)
                    took.append(time.perf_counter_ns() - w)
            offset += calls
            cpu[index].append(statistics.median(spent) / 1000)
            wall[index].append(statistics.median(took) / 1000)
    return cpu, wall


def report(all_cases: list[tuple[str, str, Step]], cpu: list[list[float]], wall: list[list[float]]) -> str:
    lines = []
    for index, (name, mode, _) in enumerate(all_cases):
        c, w = cpu[index], wall[index]
        line = (
            f"  {name:31} {mode:15} cpu {statistics.median(c):7.1f} us ({min(c):.0f}-{max(c):.0f})  "
            f"wall {statistics.median(w):7.1f} us ({min(w):.0f}-{max(w):.0f})"
        )
        if mode not in ("normal", "physical floor"):
            on = next(j for j, (n, m, _) in enumerate(all_cases) if n == name and m == "normal")
            more = [c[b] - cpu[on][b] for b in range(len(c))]
            rate = [wall[on][b] / w[b] for b in range(len(w))]
            line += (
                f"  off - on: cpu {statistics.median(more):+.1f} us ({min(more):+.0f}..{max(more):+.0f}), "
                f"rate off/on {statistics.median(rate):.2f} ({min(rate):.2f}-{max(rate):.2f})"
            )
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=9, help="rotations through every case (default 9)")
    parser.add_argument("--calls", type=int, default=150, help="calls per case per block (default 150)")
    args = parser.parse_args(argv)
    (url,), drop = lease.databases(lease.server_url(), 1)
    try:
        lease.prepare(url)
        dispatch.prepare(url)
        lease.reset(url)
        all_cases = cases(url)
        cpu, wall = measure(all_cases, args.blocks, args.calls)
        print(f"fast paths on and off, {args.blocks} blocks of {args.calls} calls per case; {load()}")
        print(report(all_cases, cpu, wall))
    finally:
        drop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
