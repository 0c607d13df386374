"""What every benchmark here shares: timed windows, rotated rounds, min / median / max, SUSPECT flags, load.

A figure a reader can trust needs five things, and this module gives each benchmark the same ones:

* **One window for every process.** :func:`run_window` forks the processes, lets each set up and warm its
  connection, then holds them at a barrier; the parent picks a start time a moment ahead, every process
  already runs its loop before it, and counts only the calls that *complete* inside ``[start, start +
  seconds]``; no process stops before every other has left the window. So all processes contend for the
  whole measured span, and none runs alone at either end (the 4-process floor that read 1.27 was timed
  per process, each from its own start).
* **Rotated rounds.** :func:`rotate` runs every side once per round, the order rotated each round, so drift
  on a shared machine hits every side alike; each round's ratio pairs the sides of that round.
* **Spread.** :class:`Stat` keeps min / median / max. A figure whose per-round ratio has a (max - min) /
  median above :data:`SPREAD_LIMIT`, or a library faster than its floor by more than :data:`RATIO_LIMIT`,
  is flagged ``SUSPECT``: the figure says more about the machine, or a broken floor, than about the code.
  A side whose own rate spreads that much is printed as ``noisy`` beside it (on this kind of machine the
  disk's commit latency moves from round to round; both sides of a round see the same disk).
* **The same server state.** A paired comparison whose windows start on emptied tables (the lease and
  enqueue sides) runs ``CHECKPOINT`` just before each window (``before_window``, with
  :func:`benchmarks.report.checkpoint`): left alone, the benchmark's own WAL brings a checkpoint every
  minute or so, and the windows right after one pay its full-page images and share the disk with its
  writes, whichever side they belong to (here the refusal's per-round ratio spread 47-114% without it,
  17-50% with it, one run each). Sides that read or rewrite rows left by earlier rounds (delivery, the
  receivers, the scale tables) do not: a checkpoint before each of their windows would charge the side
  that touches more old pages with full-page images a real server pays once per checkpoint interval.
* **The machine.** :func:`machine` describes it. :func:`background_busy` measures, while the benchmark
  itself runs nothing, how many CPUs other work keeps busy (``/proc/stat`` over a few seconds); it is
  taken before every suite and at the end, and a run where it exceeded a quarter of a CPU is labelled as
  taken under load. The load averages are printed too, but they cannot judge the run: a 4-process
  benchmark lifts its own 1-minute load above 2.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import platform
import queue
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

#: (max - min) / median above this flags a figure SUSPECT.
SPREAD_LIMIT = 0.10
#: A library faster than its floor by more than this (ratio above it) flags the floor SUSPECT.
RATIO_LIMIT = 1.05
#: CPUs' worth of other work (measured while the benchmark is idle) above which a run is labelled as taken
#: under load.
QUIET_BUSY_CPUS = 0.25
#: How far ahead of the barrier the parent puts a window's start: every process is looping by then.
LEAD_IN_S = 0.25

Step = Callable[[int], object]
Setup = Callable[[], tuple[Step, Callable[[], None]]]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One side of one round: calls per second (summed over processes) and client CPU µs per call."""

    rate: float
    cpu_us: float


@dataclasses.dataclass(frozen=True)
class Stat:
    """Min / median / max of one figure over the rounds."""

    low: float
    median: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        return cls(min(values), statistics.median(values), max(values))

    @property
    def spread(self) -> float:
        return (self.high - self.low) / self.median if self.median else 0.0


@dataclasses.dataclass(frozen=True)
class Figure:
    """One row of a table: a side beside its floor, over the same rounds.

    ``ratio`` is per round (``value / floor`` of the same round), so drift between rounds cancels.
    ``lower_is_better`` marks a cost (a time, or a slowdown) rather than a rate.
    """

    path: str
    procs: str
    floor_name: str
    floor: Stat
    value: Stat
    ratio: Stat
    unit: str = "/s"
    goal: float | None = None
    lower_is_better: bool = False
    cpu_us: tuple[float, float] | None = None  # medians: value's, floor's
    note: str = ""
    #: Why this side may beat its floor by design (the floor does more work); replaces the ratio flag.
    faster_because: str = ""

    @property
    def flags(self) -> list[str]:
        """Why the figure itself (the per-round ratio) cannot be trusted: its own spread, or a library faster
        than its floor. A side's spread alone is not a flag: the disk's commit latency moves both sides of
        a round together, and the paired ratio cancels it (:attr:`noise` reports it)."""
        out = []
        if self.ratio.spread > SPREAD_LIMIT:
            out.append(f"SUSPECT ratio spread {self.ratio.spread:.0%}")
        if not self.lower_is_better and self.ratio.median > RATIO_LIMIT and not self.faster_because:
            out.append(f"SUSPECT ratio {self.ratio.median:.2f} > {RATIO_LIMIT}: faster than its floor")
        return out

    @property
    def noise(self) -> list[str]:
        """Sides whose absolute rate moved more than :data:`SPREAD_LIMIT` between rounds."""
        return [
            f"noisy {name} {stat.spread:.0%}"
            for name, stat in (("floor", self.floor), ("measured", self.value))
            if stat.spread > SPREAD_LIMIT
        ]

    @property
    def remarks(self) -> list[str]:
        """The flags, the noisy sides, then the notes (why a ratio above 1 is expected, what the CPU column
        holds)."""
        out = list(self.flags) + self.noise
        if self.faster_because and self.ratio.median > RATIO_LIMIT:
            out.append(f"above 1 by design: {self.faster_because}")
        if self.note:
            out.append(self.note)
        return out

    @property
    def verdict(self) -> str:
        if self.goal is None:
            return "(info)"
        if self.lower_is_better:
            ok = self.ratio.median <= self.goal
            return f"<= {self.goal:.2f}x {'OK' if ok else 'MISSED'}"
        ok = self.ratio.median >= self.goal
        return f">= {self.goal:.2f} {'OK' if ok else 'MISSED'}"


def figure(
    path: str,
    procs: int | str,
    floor_name: str,
    floor: Sequence[Sample],
    value: Sequence[Sample],
    **kw: Any,
) -> Figure:
    """A :class:`Figure` from the paired samples of two sides (same rounds, same order). For a cost (a
    time in ``Sample.rate``, ``lower_is_better``) the ratio is the side's time over the floor's. Samples
    that measured no CPU (all ``cpu_us`` 0) leave the figure's CPU column empty."""
    ratios = [v.rate / f.rate for v, f in zip(value, floor, strict=True)]
    measured_cpu = any(s.cpu_us for s in (*floor, *value))
    return Figure(
        path=path,
        procs=str(procs),
        floor_name=floor_name,
        floor=Stat.of([s.rate for s in floor]),
        value=Stat.of([s.rate for s in value]),
        ratio=Stat.of(ratios),
        cpu_us=(
            (statistics.median(s.cpu_us for s in value), statistics.median(s.cpu_us for s in floor))
            if measured_cpu
            else None
        ),
        **kw,
    )


def rotate(rounds: int, sides: dict[str, Callable[[], Sample]]) -> dict[str, list[Sample]]:
    """Run every side once per round, the order rotated by one each round (two sides alternate)."""
    names = list(sides)
    got: dict[str, list[Sample]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            got[name].append(sides[name]())
    return got


# -- one window for every process ---------------------------------------------------------------------


def _child(
    setup: Setup,
    seconds: float,
    warm: int,
    ready: Any,
    start_at: Any,
    left: Any,
    results: Any,
) -> None:
    step, close = setup()
    i = 0
    for _ in range(warm):  # connect, prepare, fill caches: what a long-running worker has done already
        step(i)
        i += 1
    ready.wait()
    ready.wait()  # the parent has written the start time between the two waits
    start = start_at.value
    end = start + seconds
    clock = time.perf_counter
    while clock() < start:
        step(i)
        i += 1
    count = 0
    cpu0, wall0 = time.process_time(), clock()
    now = wall0
    while now < end:
        step(i)
        i += 1
        now = clock()
        if now <= end:
            count += 1
    cpu = time.process_time() - cpu0
    wall = min(now, end) - wall0
    with left.get_lock():
        left.value += 1
    while left.value < ready.parties - 1:  # keep contending until every process has left the window
        step(i)
        i += 1
    close()
    results.put((count, cpu, wall))


def run_window(
    setup: Setup,
    processes: int,
    seconds: float,
    *,
    warm: int = 10,
    before_window: Callable[[], None] | None = None,
) -> Sample:
    """Fork ``processes`` workers, each running ``setup()`` then its step in a loop; all are timed over the
    same window of ``seconds`` (see the module docstring). ``setup`` returns ``(step, close)``; ``step(i)``
    gets a counter unique within its process. Returns calls/s over all processes and CPU µs per call
    (``time.process_time``: every thread of the worker, not the server's). ``before_window`` runs in the
    parent once every worker has set up and warmed, just before the window's start is set (e.g.
    :func:`checkpoint`)."""
    mp = multiprocessing.get_context("fork")
    ready = mp.Barrier(processes + 1)
    start_at = mp.Value("d", 0.0)
    left = mp.Value("i", 0)
    results = mp.Queue()
    procs = [
        mp.Process(target=_child, args=(setup, seconds, warm, ready, start_at, left, results))
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        _wait_barrier(ready, procs)
        if before_window is not None:
            before_window()
        start_at.value = time.perf_counter() + LEAD_IN_S
        _wait_barrier(ready, procs)
        got: list[tuple[int, float, float]] = []
        deadline = time.monotonic() + seconds + 300
        while len(got) < processes:
            try:
                got.append(results.get(timeout=0.5))
            except queue.Empty:
                _check_alive(procs)
                if time.monotonic() > deadline:
                    raise SystemExit(
                        "benchmark workers did not finish within 300 s of their window"
                    ) from None
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    rate = sum(count / wall for count, _, wall in got if wall > 0)
    calls = sum(count for count, _, _ in got)
    return Sample(rate, sum(cpu for _, cpu, _ in got) / max(calls, 1) * 1e6)


def _wait_barrier(barrier: Any, procs: Sequence[Any]) -> None:
    """The parent's wait at the barrier, failing fast if a worker died during its setup."""
    done = threading.Event()
    error: list[BaseException] = []

    def wait() -> None:
        try:
            barrier.wait(timeout=300)
        except BaseException as exc:  # a broken barrier: reported below
            error.append(exc)
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    while not done.wait(0.5):
        try:
            _check_alive(procs)
        except SystemExit:
            barrier.abort()
            raise
    if error:
        raise SystemExit(f"benchmark workers never met at the barrier: {error[0]!r}")


def _check_alive(procs: Sequence[Any]) -> None:
    failed = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
    if failed:
        raise SystemExit(f"a benchmark worker failed (exit codes {failed})")


# -- the machine ----------------------------------------------------------------------------------------


def load() -> str:
    """The load averages beside the CPU count, e.g. ``load 3.10 / 2.50 / 1.90 on 2 CPUs``."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min) on {os.cpu_count()} CPUs"


def under_load(busy: float | None = None) -> bool:
    """True when other work kept more than a quarter of a CPU busy (``busy`` from
    :func:`background_busy`, measured now when not given)."""
    return (background_busy() if busy is None else busy) > QUIET_BUSY_CPUS


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return total - idle, total


def background_busy(seconds: float = 3.0) -> float:
    """How many CPUs' worth of work others did over ``seconds`` while this benchmark ran nothing (it only
    sleeps here): 0.0 on a quiet machine, 2.0 with both cores of a 2-core machine busy. Falls back to the
    1-minute load average where ``/proc/stat`` is missing."""
    first = _cpu_jiffies()
    time.sleep(seconds)
    second = _cpu_jiffies()
    if first is None or second is None or second[1] == first[1]:
        return os.getloadavg()[0]
    return (second[0] - first[0]) / (second[1] - first[1]) * (os.cpu_count() or 1)


def machine(pg_settings: dict[str, str] | None = None) -> str:
    """CPU model, cores, memory, OS and Python, and PostgreSQL's version and durability settings."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = ""
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        memory = f", {kib / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    text = (
        f"{model}, {os.cpu_count()} CPUs{memory}, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}"
    )
    if pg_settings:
        version = pg_settings.get("server_version", "?").split()[0]
        rest = ", ".join(f"{k} {v}" for k, v in pg_settings.items() if k != "server_version")
        text += f"; PostgreSQL {version} ({rest})"
    return text


def pg_settings(conn: Any) -> dict[str, str]:
    """The server settings a reader needs to compare runs (psycopg connection)."""
    out = {}
    for name in ("server_version", "fsync", "synchronous_commit", "shared_buffers"):
        row = conn.execute(f"SHOW {name}").fetchone()
        out[name] = str(row[0]) if row else "?"
    return out


# -- printing -------------------------------------------------------------------------------------------


def _num(value: float, unit: str) -> str:
    if unit == "/s":
        return f"{value:,.0f}"
    if unit == "ms":
        return f"{value:.2f}"
    return f"{value:.0f}"


def cells(fig: Figure) -> list[str]:
    """The figure as text cells: path, procs, floor and value as median (min-max), ratio, CPU, verdict."""

    def stat(s: Stat) -> str:
        return f"{_num(s.median, fig.unit)} ({_num(s.low, fig.unit)}-{_num(s.high, fig.unit)}){fig.unit}"

    ratio = f"{fig.ratio.median:.2f} ({fig.ratio.low:.2f}-{fig.ratio.high:.2f})"
    cpu = "-" if fig.cpu_us is None else f"{fig.cpu_us[0]:.0f} / {fig.cpu_us[1]:.0f}"
    return [
        fig.path,
        fig.procs,
        f"{fig.floor_name}: {stat(fig.floor)}",
        stat(fig.value),
        ratio,
        cpu,
        fig.verdict,
        "; ".join(fig.remarks),
    ]


HEADERS = ("path", "procs", "floor: median (min-max)", "measured", "ratio", "cpu us/call", "goal", "flags")


def print_figures(
    title: str, figures: Sequence[Figure], rounds: int, started: float, busy: float | None = None
) -> None:
    """An aligned table of the figures, with the rounds, the machine's load and the run's time; ``busy``
    is other work's CPUs (:func:`background_busy`), measured now (3 s) when not given."""
    rows = [cells(f) for f in figures]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADERS)]
    busy = background_busy() if busy is None else busy
    print(
        f"\n{title}: medians (min-max) of {rounds} rotated rounds; other work {busy:.2f} CPUs "
        f"(measured idle, after the suite); {load()}"
    )
    if under_load(busy):
        print("UNDER LOAD: the machine was busy; read ratios, not absolute rates, and rerun on a quiet one")
    print(" | ".join(h.ljust(w) for h, w in zip(HEADERS, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print(f"total runtime {time.perf_counter() - started:.0f} s", flush=True)
