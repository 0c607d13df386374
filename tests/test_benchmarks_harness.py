"""The benchmark harness counts what it says and flags what it should (no timing is asserted)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import receiver as receiver_bench
from benchmarks import report
from benchmarks.__main__ import BEGIN, END, markdown, write_page
from benchmarks.harness import Figure, Sample, Stat, background_busy, figure, rotate, run_window
from benchmarks.plain_receiver import CREATE_SQL
from tests.conftest import _admin_execute


def _counter_setup() -> tuple[object, object]:
    calls: list[int] = []

    def step(i: int) -> None:
        calls.append(i)

    return step, (lambda: None)


def test_run_window_counts_calls_of_every_process_in_one_window() -> None:
    sample = run_window(_counter_setup, 3, 0.2, warm=2)  # type: ignore[arg-type]
    assert sample.rate > 0
    assert sample.cpu_us > 0


def test_before_window_runs_once_after_every_worker_is_ready_and_before_the_window() -> None:
    ran: list[int] = []

    def before() -> None:
        ran.append(len(multiprocessing.active_children()))

    sample = run_window(_counter_setup, 2, 0.2, warm=2, before_window=before)  # type: ignore[arg-type]
    assert sample.rate > 0
    assert ran == [2]  # once, in the parent, with both workers started and waiting at the barrier


def test_checkpoint_runs_as_a_superuser_and_is_skipped_with_one_note_without_the_right(
    pg_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "_checkpoint_refused", [])
    assert report.checkpoint(pg_url) is True
    role = f"joblease_bench_{uuid.uuid4().hex[:10]}"
    _admin_execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        url = make_url(pg_url).set(username=role)
        assert report.checkpoint(url) is False
        assert report.checkpoint(url) is False
        assert report.checkpoint(pg_url) is False  # once refused, the run stops asking
        err = capsys.readouterr().err
        assert err.count("CHECKPOINT refused") == 1 and "pg_checkpoint" in err
    finally:
        _admin_execute(f'DROP ROLE IF EXISTS "{role}"')


def test_run_window_reports_a_worker_that_fails_in_setup() -> None:
    def broken() -> tuple[object, object]:
        raise RuntimeError("no database")

    with pytest.raises(SystemExit, match="worker failed"):
        run_window(broken, 2, 0.1)  # type: ignore[arg-type]


def test_rotate_runs_every_side_every_round_in_rotated_order() -> None:
    order: list[str] = []

    def side(name: str) -> Sample:
        order.append(name)
        return Sample(1.0, 0.0)

    got = rotate(3, {n: (lambda n=n: side(n)) for n in ("a", "b", "c")})  # type: ignore[misc]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(len(v) == 3 for v in got.values())


def test_spread_and_a_ratio_above_its_floor_are_flagged_suspect() -> None:
    steady = [Sample(100.0, 1.0)] * 5
    noisy = [Sample(r, 1.0) for r in (80.0, 100.0, 100.0, 100.0, 120.0)]
    fast = [Sample(120.0, 1.0)] * 5
    assert figure("p", 1, "floor", steady, steady, goal=0.8).flags == []
    noisy_fig = figure("p", 1, "floor", steady, noisy, goal=0.8)
    assert any("ratio spread" in f for f in noisy_fig.flags)
    assert "noisy measured 40%" in noisy_fig.noise
    assert any("SUSPECT ratio" in f for f in figure("p", 1, "floor", steady, fast, goal=0.8).flags)
    explained = figure("p", 1, "floor", steady, fast, goal=0.8, faster_because="floor locks")
    assert explained.flags == []
    assert any("by design" in r for r in explained.remarks)
    paired = figure("p", 1, "floor", noisy, noisy, goal=0.8)
    assert paired.ratio == Stat(1.0, 1.0, 1.0)  # per-round ratios pair the sides of one round
    assert paired.flags == []  # both sides drifted together: noisy, not suspect
    assert paired.noise == ["noisy floor 40%", "noisy measured 40%"]


def test_readme_block_is_written_between_the_markers_only(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    fig = Figure("claim", "1", "physical", Stat(1, 2, 3), Stat(1, 2, 3), Stat(1, 1, 1), goal=0.8)
    write_page(markdown([fig], "Taken now."), readme)
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n")
    assert text.endswith("\nafter\n")
    assert "old table" not in text
    assert "| claim | 1 | physical |" in text
    assert "Taken now." in text
    readme.write_text("no markers")
    with pytest.raises(SystemExit, match="markers"):
        write_page("x", readme)


def test_background_busy_sees_other_work_and_not_a_sleeping_benchmark() -> None:
    idle = background_busy(0.5)
    spinner = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    spinner.start()
    try:
        busy = background_busy(1.0)
    finally:
        spinner.kill()
        spinner.join()
    assert 0.0 <= idle <= (os.cpu_count() or 1)
    assert busy >= 0.5  # one process spinning on a core shows as (at least) half a CPU


def _spin() -> None:
    while True:
        pass


def _ratio_figure(path: str, low: float, median: float, high: float) -> Figure:
    stat = Stat(low, median, high)
    return Figure(path=path, procs="1", floor_name="physical", floor=stat, value=stat, ratio=stat)


def test_two_saved_runs_agree_only_where_each_median_lies_in_the_others_range(tmp_path: Path) -> None:
    from benchmarks import agreement

    first = [
        _ratio_figure("claim", 0.70, 0.74, 0.78),
        _ratio_figure("enqueue", 0.80, 0.82, 0.84),
        _ratio_figure("refused", 1.40, 1.45, 1.50),
        _ratio_figure("gone", 1.0, 1.0, 1.0),
    ]
    saved = tmp_path / "a.json"
    agreement.dump(first, "2026-12-01 15:00 UTC", saved)
    second = [
        _ratio_figure("claim", 0.72, 0.76, 0.80),  # each median inside the other's range
        _ratio_figure("enqueue", 0.83, 0.86, 0.90),  # ranges meet, 0.86 is outside 0.80-0.84
        _ratio_figure("refused", 1.60, 1.70, 1.80),  # ranges apart
        _ratio_figure("new", 1.0, 1.0, 1.0),
    ]
    got = agreement.compare(second, agreement.load(saved))
    assert (got.agree, got.compared, got.only_one) == (1, 3, 2)
    assert [line.split()[0] for line in got.lines[:3]] == ["agree", "overlap", "apart"]
    assert got.summary == "1 of 3 figures agree (2 in only one run)"
    assert any("only in the saved run: gone" in line for line in got.lines)


def test_agree_with_a_file_that_is_not_a_saved_run_says_so(tmp_path: Path) -> None:
    from benchmarks import agreement

    bad = tmp_path / "b.json"
    bad.write_text('{"figures": []}')
    with pytest.raises(SystemExit, match="not a run saved by --save"):
        agreement.load(bad)
    with pytest.raises(SystemExit, match="cannot read"):
        agreement.load(tmp_path / "missing.json")


def test_the_receiver_benchmarks_side_rows_run_small(pg_engine: sa.Engine) -> None:
    """The middleware's latency rows and the async-vs-sync inbox row, with tiny settings."""
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(CREATE_SQL)
    url = pg_engine.url.render_as_string(hide_password=False)
    for kind in ("bare", "apply", "replay"):
        assert receiver_bench._middleware_latency(url, kind, 5) > 0
    with pg_engine.connect() as conn:
        # bare and apply write one row per new key (warm-up included); replay writes its key once
        assert conn.exec_driver_sql("SELECT count(*) FROM plain_effect").scalar_one() == 2 * 25 + 1
        assert conn.exec_driver_sql("SELECT count(*) FROM joblease_inbox").scalar_one() == 25 + 1
    assert receiver_bench._async_keys_per_s(url, 0.2, keys=4) > 0
    assert receiver_bench._sync_keys_per_s(url, 0.2, keys=4) > 0


def test_a_cost_figure_pairs_times_and_leaves_the_cpu_column_empty_when_none_was_measured() -> None:
    fig = figure(
        "t",
        1,
        "floor",
        [Sample(10.0, 0.0), Sample(20.0, 0.0)],
        [Sample(15.0, 0.0), Sample(20.0, 0.0)],
        unit="ms",
        lower_is_better=True,
    )
    assert fig.ratio == Stat(1.0, 1.25, 1.5) and fig.cpu_us is None
    assert figure("r", 1, "floor", [Sample(10.0, 5.0)], [Sample(8.0, 6.0)]).cpu_us == (6.0, 5.0)


def test_the_fast_paths_benchmark_runs_every_case_small_and_puts_each_fast_path_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import fastpaths
    from dagster_joblease.storage import driver
    from dagster_joblease.storage import outbox as outbox_store

    before = (
        driver.is_psycopg,
        driver.in_transaction,
        outbox_store._claim_template,
        outbox_store._mark_sent_statement,
    )
    assert fastpaths.main(["--blocks", "1", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    for mode in ("no-autocommit", "no-hint", "fresh-cursors", "no-claim-memo", "no-mark-memo"):
        assert f" {mode} " in out and "off - on: cpu" in out
    after = (
        driver.is_psycopg,
        driver.in_transaction,
        outbox_store._claim_template,
        outbox_store._mark_sent_statement,
    )
    assert after == before


def test_the_checkouts_benchmark_measures_a_checkout_in_a_process_of_its_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import checkouts

    root = str(Path(__file__).resolve().parent.parent)
    small = ["--reps", "1", "--calls", "3", "--rounds", "1", "--only", "enqueue,claim"]
    assert checkouts.main([root, *small]) == 0
    out = capsys.readouterr().out
    assert f"{root}: enqueue " in out and " claim " in out


@pytest.mark.chaos
def test_the_kill_to_effect_benchmark_times_one_kill_and_says_what_it_is_made_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One round with run retries on: a real daemon, a SIGKILLed run worker, the receiver's effect."""
    from benchmarks import kill_to_effect

    assert kill_to_effect.main(["--rounds", "1", "--retries", "on", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "FAILURE +" in out and "holder dead +" in out  # its code server marked the killed run failed
    assert "median" in out and all(f"{part} " in out for part in kill_to_effect.PARTS)
