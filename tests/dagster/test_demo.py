"""The demo's pure decisions, table-driven: its plan, when it has settled, how its runs and effects count.
(The demo itself runs end to end in tests/dagster/test_definitions.py and test_demo_wheel.py.)"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

import pytest

from dagster_joblease import identity
from dagster_joblease.demo import runner as demo
from dagster_joblease.demo.runner import RunTally


def key(day: str) -> str:
    return identity.idempotency_key("SCHEDULE", demo.BILLING_CODE, day)


@pytest.mark.parametrize(
    ("partitions", "now", "days"),
    [
        (2, dt.datetime(2026, 3, 1, 0, 30, tzinfo=dt.UTC), ("2026-02-27", "2026-02-28")),
        (3, dt.datetime(2026, 1, 1, 23, 59, tzinfo=dt.UTC), ("2025-12-29", "2025-12-30", "2025-12-31")),
    ],
)
def test_the_plan_kills_the_second_to_last_day_and_ticks_for_the_last(
    partitions: int, now: dt.datetime, days: tuple[str, ...], tmp_path: Path
) -> None:
    plan = demo.demo_plan(partitions, tmp_path, now)
    assert plan.days == days
    assert (plan.killed_day, plan.overlap_day) == (days[-2], days[-1])
    assert plan.tick == dt.datetime.combine(now.date(), dt.time(2, 0), tzinfo=dt.UTC)
    assert (plan.home, plan.kill_dir) == (tmp_path / "dagster_home", tmp_path / "kill")
    assert plan.joblease_url == f"sqlite:///{tmp_path / 'joblease.sqlite'}"
    assert plan.receiver_url == f"sqlite:///{tmp_path / 'receiver.sqlite'}"


@pytest.mark.parametrize(
    ("states", "delivered", "unfinished", "line", "done"),
    [
        ({}, 0, 0, "[5/6] 0/3 partitions done, 0/3 delivered, 0 run(s) not finished", False),
        (
            {"a": "SUCCESS", "b": "SUCCESS", "c": "RUNNING"},
            2,
            1,
            "[5/6] 2/3 partitions done, 2/3 delivered, 1",
            False,
        ),
        ({"a": "SUCCESS", "b": "SUCCESS", "c": "FAIL"}, 3, 0, "[5/6] 2/3 partitions done, 3/3", False),
        ({"a": "SUCCESS", "b": "SUCCESS", "c": "SUCCESS"}, 2, 0, "[5/6] 3/3 partitions done, 2/3", False),
        ({"a": "SUCCESS", "b": "SUCCESS", "c": "SUCCESS"}, 3, 1, "[5/6] 3/3 partitions done, 3/3", False),
        ({"a": "SUCCESS", "b": "SUCCESS"}, 3, 0, "[5/6] 2/3 partitions done", False),  # a day without a row
        (
            {"a": "SUCCESS", "b": "SUCCESS", "c": "SUCCESS"},
            3,
            0,
            "[5/6] 3/3 partitions done, 3/3 delivered",
            True,
        ),
    ],
)
def test_the_demo_settles_when_every_partition_is_done_delivered_and_no_run_is_left(
    states: dict[str, str], delivered: int, unfinished: int, line: str, done: bool
) -> None:
    shown, settled = demo.settle_status(states, delivered, unfinished, 3)
    assert shown.startswith(line), shown
    assert settled is done


@pytest.mark.parametrize(
    ("runs", "tally"),
    [
        ([], RunTally()),
        ([("won", False, True), ("skipped: held by a live lease", False, True)], RunTally(won=1, skipped=1)),
        (
            [("won", True, False), ("reclaimed", False, True)],
            RunTally(reclaimed=1, killed=1),
        ),  # the killed run
        ([("", True, False)], RunTally(killed=1)),  # failed before it claimed
        ([("won", False, False)], RunTally(other=1)),  # neither failed nor succeeded (still running)
        ([("", False, True), ("lost", False, True)], RunTally(other=2)),  # succeeded without a known outcome
    ],
)
def test_runs_are_tallied_by_outcome_and_end(runs: list[tuple[str, bool, bool]], tally: RunTally) -> None:
    assert demo.tally_runs(runs) == tally


@pytest.mark.parametrize(
    ("applied", "count"),
    [
        ({}, 0),
        ({key("2026-01-01"): {"billingDate": "2026-01-01"}}, 1),
        ({key("2026-01-01"): {"billingDate": "2026-01-02"}}, 0),  # another day's payload
        ({key(d): {"billingDate": d} for d in ("2026-01-01", "2026-01-02")}, 2),
        ({key("2025-12-31"): {"billingDate": "2025-12-31"}}, 0),  # not one of the days
    ],
)
def test_one_effect_per_day_counts_each_days_own_payload(applied: dict[str, Any], count: int) -> None:
    assert demo.one_effect_count(applied, ["2026-01-01", "2026-01-02"]) == count


@pytest.mark.parametrize("before", [None, "kept"])
def test_the_demos_environment_is_put_back(before: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "JOBLEASE_DEMO_TEST_VARIABLE"
    if before is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, before)
    with pytest.raises(RuntimeError), demo._restored_env([name]):
        os.environ[name] = "changed"
        raise RuntimeError("the demo failed")
    assert os.environ.get(name) == before
