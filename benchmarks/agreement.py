"""Do two runs of ``python -m benchmarks`` agree within the spread they report?

``--save FILE`` writes a run's figures as JSON; ``--agree-with FILE`` compares this run with a saved one,
prints one line per figure and puts the count in the docs' header. The rule, per figure (its per-round
ratio): the runs **agree** when each run's median lies inside the other run's min-max. Ranges that only
overlap are counted apart (``overlap``): the medians moved more than the rounds of either run spread, so
the figure drifted between the runs (on this kind of machine, the disk's commit latency does so for
minutes at a time). Figures are matched by path, process count and floor; a figure in only one run is
reported, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import Figure, Stat

FORMAT = 1


def _key(path: str, procs: str, floor_name: str) -> str:
    return f"{path.strip()} | {procs} | {floor_name}"


def dump(figures: Sequence[Figure], taken: str, path: Path) -> None:
    """Write ``figures`` (each with its ratio, floor and value stats) and when they were taken."""
    rows = [
        {
            "key": _key(f.path, f.procs, f.floor_name),
            "ratio": dataclasses.astuple(f.ratio),
            "floor": dataclasses.astuple(f.floor),
            "value": dataclasses.astuple(f.value),
            "unit": f.unit,
            "flags": f.flags,
        }
        for f in figures
    ]
    path.write_text(json.dumps({"format": FORMAT, "taken": taken, "figures": rows}, indent=1) + "\n")


@dataclasses.dataclass(frozen=True)
class Saved:
    taken: str
    ratios: dict[str, Stat]


def load(path: Path) -> Saved:
    """A run written by :func:`dump`; a file of another kind fails with what is wrong with it."""
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--agree-with {path}: cannot read a saved benchmark run ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or "figures" not in data:
        raise SystemExit(f"--agree-with {path}: not a run saved by --save (format {FORMAT})")
    ratios = {row["key"]: Stat(*row["ratio"]) for row in data["figures"]}
    return Saved(str(data.get("taken", "?")), ratios)


def verdict(a: Stat, b: Stat) -> str:
    """``agree`` (each median inside the other's min-max), ``overlap`` (the ranges meet, a median is
    outside the other's), or ``apart`` (the ranges do not meet)."""
    if a.low <= b.median <= a.high and b.low <= a.median <= b.high:
        return "agree"
    if a.low <= b.high and b.low <= a.high:
        return "overlap"
    return "apart"


@dataclasses.dataclass(frozen=True)
class Comparison:
    lines: list[str]
    agree: int
    compared: int
    only_one: int

    @property
    def summary(self) -> str:
        text = f"{self.agree} of {self.compared} figures agree"
        if self.only_one:
            text += f" ({self.only_one} in only one run)"
        return text


def compare(figures: Sequence[Figure], saved: Saved) -> Comparison:
    """One line per figure of this run against the saved run, and the counts."""
    lines, agree, compared = [], 0, 0
    seen = set()
    for f in figures:
        key = _key(f.path, f.procs, f.floor_name)
        seen.add(key)
        other = saved.ratios.get(key)
        if other is None:
            lines.append(f"  only in this run: {key}")
            continue
        compared += 1
        word = verdict(f.ratio, other)
        agree += word == "agree"
        lines.append(
            f"  {word:7} {f.ratio.median:.2f} ({f.ratio.low:.2f}-{f.ratio.high:.2f}) vs "
            f"{other.median:.2f} ({other.low:.2f}-{other.high:.2f})  {key}"
        )
    missing = [k for k in saved.ratios if k not in seen]
    lines += [f"  only in the saved run: {k}" for k in missing]
    only_one = len(lines) - compared
    return Comparison(lines, agree, compared, only_one)
