"""The reconciliation judge, table-driven: facts in, verdicts out, no database and no Dagster instance."""

from __future__ import annotations

import dataclasses

import dagster as dg
import pytest

from dagster_joblease.dagster.reconcile import judge
from dagster_joblease.dagster.reconcile.facts import materialized_fact, records_wanted
from dagster_joblease.dagster.reconcile.judge import (
    Action,
    Free,
    KeyFacts,
    KeyRuns,
    LeaseFacts,
    Life,
    Named,
    Need,
    Policy,
    Run,
    Verdict,
)

S = dg.DagsterRunStatus
JOB = Policy(cap=3, backoff_ms=60_000, max_backoff_ms=600_000, may_wait_ms=300_000, legacy_stale_ms=30_000)
ASSET = dataclasses.replace(JOB, asset=True)
HOLDER = "dagster:prod/0c1f2d3e-1111-2222-3333-444455556666"
HOLDER_RUN = "0c1f2d3e-1111-2222-3333-444455556666"
FINISHED_STALE = (
    "its run here is FAILURE and its heartbeat (every 1000 ms) is 2500 ms old (lease of k, attempt 2)"
)
SILENT = "its heartbeat (every 1000 ms) is 4500 ms old: 4 of its own intervals missed (lease of k, attempt 2)"
NAMED = Named("run-r", "range run run-r failed: held")


def lease(status: str = "RUNNING", **kw: object) -> LeaseFacts:
    base: dict[str, object] = {
        "key": "k",
        "status": status,
        "attempt": 2,
        "holder": HOLDER,
        "heartbeat_ms": 1_000,
    }
    base.update(kw)
    return LeaseFacts(**base)  # type: ignore[arg-type]


# ---- step 1: what the lease row (and who named the key) says -------------------------------------------

NEED_CASES = [
    (
        "no row, nothing names it",
        JOB,
        KeyFacts("k"),
        Verdict("k", Action.DONE, "no lease row and nothing names it"),
    ),
    ("no row, a run left it undone", JOB, KeyFacts("k", named=(NAMED,)), Need("k", NAMED.why)),
    ("no row, catch-up", JOB, KeyFacts("k", catch_up=True), Need("k", "never attempted (catch-up)")),
    (
        "no row, upstream did not finish it",
        ASSET,
        KeyFacts("k", named=(dataclasses.replace(NAMED, upstream=("up",)),)),
        Need("k", NAMED.why, upstream=("up",)),
    ),
    ("FAIL", JOB, KeyFacts("k", lease("FAIL", idle_ms=5)), Need("k", "lease FAIL", 2, 5)),
    (
        "RUNNING, fresh",
        JOB,
        KeyFacts("k", lease(heartbeat_age_ms=1_500)),
        Verdict("k", Action.LIVE, f"held by {HOLDER}"),
    ),
    (
        "RUNNING, expired",
        JOB,
        KeyFacts("k", lease(overdue_ms=10, idle_ms=7)),
        Need("k", "lease expired", 2, 7),
    ),
    (
        "RUNNING, stale by its own interval, its run here finished",
        JOB,
        KeyFacts("k", lease(heartbeat_age_ms=2_500, idle_ms=2_500), holder_status=S.FAILURE),
        Need(
            "k",
            f"dead holder {HOLDER}",
            2,
            2_500,
            free=Free(2, 2_000, f"dead holder {HOLDER}: {FINISHED_STALE}", HOLDER_RUN),
        ),
    ),
    (
        "RUNNING, stale but under the failover tolerance, its run here still STARTED: alive (#35 item 3)",
        JOB,
        KeyFacts("k", lease(heartbeat_age_ms=3_500, idle_ms=3_500), holder_status=S.STARTED),
        Verdict("k", Action.LIVE, f"held by {HOLDER}"),
    ),
    (
        "RUNNING, 4 intervals missed, its run here still STARTED: a zombie",
        JOB,
        KeyFacts("k", lease(heartbeat_age_ms=4_500, idle_ms=4_500), holder_status=S.STARTED),
        Need(
            "k",
            f"zombie holder {HOLDER}",
            2,
            4_500,
            free=Free(2, 4_000, f"zombie holder {HOLDER}: {SILENT}", HOLDER_RUN),
        ),
    ),
    (
        "RUNNING, stale, its run not on this instance: alive",
        JOB,
        KeyFacts("k", lease(heartbeat_age_ms=2_500)),
        Verdict("k", Action.LIVE, f"held by {HOLDER}"),
    ),
    (
        "RUNNING, 4 intervals missed, its run not on this instance: dead by the lease alone",
        JOB,
        KeyFacts("k", lease(heartbeat_age_ms=4_500, idle_ms=4_500)),
        Need(
            "k",
            f"dead holder {HOLDER}",
            2,
            4_500,
            free=Free(2, 4_000, f"dead holder {HOLDER}: {SILENT}", HOLDER_RUN),
        ),
    ),
    (
        "RUNNING, a holder that never heartbeats is never stale",
        JOB,
        KeyFacts("k", lease(heartbeat_ms=0, heartbeat_age_ms=10**9), holder_status=S.FAILURE),
        Verdict("k", Action.LIVE, f"held by {HOLDER}"),
    ),
    (
        "RUNNING, a row from before 0002: the judge's legacy threshold",
        JOB,
        KeyFacts("k", lease(heartbeat_ms=None, heartbeat_age_ms=20_000), holder_status=S.FAILURE),
        Verdict("k", Action.LIVE, f"held by {HOLDER}"),
    ),
    (
        "RUNNING, holder_stale_ms lengthens the holder's threshold",
        dataclasses.replace(JOB, holder_stale_ms=60_000),
        KeyFacts("k", lease(heartbeat_age_ms=30_000), holder_status=S.FAILURE),
        Verdict("k", Action.LIVE, f"held by {HOLDER}"),
    ),
    (
        "SUCCESS, a job nobody here left undone",
        JOB,
        KeyFacts("k", lease("SUCCESS")),
        Verdict("k", Action.DONE, "lease SUCCESS"),
    ),
    (
        "SUCCESS, a job whose run here failed held",
        JOB,
        KeyFacts("k", lease("SUCCESS", idle_ms=9), named=(NAMED,)),
        Need("k", f"{NAMED.why}; done by {HOLDER}", 2, 9, until_green=True),
    ),
    (
        "SUCCESS, an asset materialized here",
        ASSET,
        KeyFacts("k", lease("SUCCESS"), named=(NAMED,), materialized=True),
        Verdict("k", Action.DONE, "lease SUCCESS"),
    ),
    (
        "SUCCESS, an asset a run here left undone, not materialized here (another deployment did it)",
        ASSET,
        KeyFacts("k", lease("SUCCESS"), named=(NAMED,), materialized=False),
        Verdict("k", Action.RECORD, "done, no materialization here", 2, winner=HOLDER_RUN),
    ),
    (
        "SUCCESS, an asset whose holder run here finished without recording it",
        ASSET,
        KeyFacts("k", lease("SUCCESS"), holder_status=S.FAILURE, materialized=False),
        Verdict("k", Action.RECORD, "done, no materialization here", 2, winner=HOLDER_RUN),
    ),
    (
        "SUCCESS, an asset whose holder run here is a zombie",
        ASSET,
        KeyFacts("k", lease("SUCCESS"), holder_status=S.STARTED, holder_dead=True, materialized=False),
        Verdict("k", Action.RECORD, "done, no materialization here", 2, winner=HOLDER_RUN),
    ),
    (
        "SUCCESS, an asset whose holder run here is alive: it records it itself",
        ASSET,
        KeyFacts("k", lease("SUCCESS"), holder_status=S.STARTED, materialized=False),
        Verdict("k", Action.DONE, "lease SUCCESS"),
    ),
    (
        "SUCCESS, an asset this deployment never asked for",
        ASSET,
        KeyFacts("k", lease("SUCCESS"), materialized=False),
        Verdict("k", Action.DONE, "lease SUCCESS"),
    ),
]


@pytest.mark.parametrize(
    ("policy", "facts", "expected"), [c[1:] for c in NEED_CASES], ids=[c[0] for c in NEED_CASES]
)
def test_need_of(policy: Policy, facts: KeyFacts, expected: Verdict | Need) -> None:
    assert judge.need_of(facts, policy) == expected


# ---- step 2: a key that needs a run, with its runs ------------------------------------------------------

NEED = Need("k", "lease FAIL", 2, idle_ms=3_600_000)
NO_ROW = Need("k", NAMED.why, 0, None)
RANGE_ALIVE = Run("r-live", S.STARTED, created_age_ms=10**7, is_range=True)
LIVES = {
    "r-live": Life(live=True),
    "r-dead": Life(live=False, dead="its lease of k2 expired 60 s ago (attempt 1)"),
    "r-quiet": Life(live=False, quiet_ms=400_000),
    "r-young": Life(live=False, quiet_ms=1_000),
}

VERDICT_CASES = [
    ("no runs: relaunch", NEED, KeyRuns(), Verdict("k", Action.RELAUNCH, "lease FAIL", 2, 1)),
    ("a queued run", NEED, KeyRuns((Run("q", S.QUEUED),)), Verdict("k", Action.IN_FLIGHT, "run q is QUEUED")),
    (
        "a range run alive on another key covers it",
        NEED,
        KeyRuns((RANGE_ALIVE,)),
        Verdict("k", Action.IN_FLIGHT, "run r-live is STARTED"),
    ),
    (
        "a zombie run (its lease expired) is not in flight",
        NEED,
        KeyRuns((Run("r-dead", S.STARTED),)),
        Verdict("k", Action.RELAUNCH, "lease FAIL", 2, 1),
    ),
    (
        "a run holding nothing, quiet past the held wait: a zombie",
        NEED,
        KeyRuns((Run("r-quiet", S.STARTED),)),
        Verdict("k", Action.RELAUNCH, "lease FAIL", 2, 1),
    ),
    (
        "a run holding nothing, young: may be waiting for a holder",
        NEED,
        KeyRuns((Run("r-young", S.STARTED),)),
        Verdict("k", Action.IN_FLIGHT, "run r-young is STARTED"),
    ),
    (
        "latest run canceled by a person",
        NEED,
        KeyRuns((Run("c", S.CANCELED), Run("f", S.FAILURE))),
        Verdict("k", Action.CANCELED, "run c was canceled"),
    ),
    (
        "a canceled run followed by a failed one",
        NEED,
        KeyRuns((Run("f", S.FAILURE), Run("c", S.CANCELED))),
        Verdict("k", Action.RELAUNCH, "lease FAIL", 2, 1),
    ),
    (
        "done elsewhere, a later run here is green",
        Need("k", "x", 1, 5, until_green=True),
        KeyRuns((Run("s", S.SUCCESS), Run("f", S.FAILURE))),
        Verdict("k", Action.DONE, "a later run settled it"),
    ),
    (
        "done elsewhere, the latest run here failed",
        Need("k", "x", 1, 5, until_green=True),
        KeyRuns((Run("f", S.FAILURE),)),
        Verdict("k", Action.RELAUNCH, "x", 1, 1),
    ),
    (
        "capped",
        NEED,
        KeyRuns((Run("f", S.FAILURE),), relaunches=3, last_relaunch="f"),
        Verdict("k", Action.CAPPED, "3 relaunches (lease FAIL); last run f"),
    ),
    (
        "the second relaunch waits the backoff after the lease's last activity",
        dataclasses.replace(NEED, idle_ms=30_000),
        KeyRuns((Run("f", S.FAILURE),), relaunches=1, last_relaunch="f"),
        Verdict("k", Action.BACKING_OFF, "relaunch 2 in 30 s"),
    ),
    (
        "past the backoff",
        dataclasses.replace(NEED, idle_ms=61_000),
        KeyRuns((Run("f", S.FAILURE),), relaunches=1, last_relaunch="f"),
        Verdict("k", Action.RELAUNCH, "lease FAIL", 2, 2),
    ),
    (
        "no row: the backoff counts from the last relaunch's end",
        NO_ROW,
        KeyRuns((Run("f", S.FAILURE),), relaunches=2, last_relaunch="f", last_relaunch_end_age_ms=90_000),
        Verdict("k", Action.BACKING_OFF, "relaunch 3 in 30 s"),
    ),
    (
        "a dead holder's lease is freed before the relaunch",
        Need("k", "dead holder h", 4, 10, free=Free(4, 2_000, "r")),
        KeyRuns(),
        Verdict("k", Action.RELAUNCH, "dead holder h", 4, 1, free=Free(4, 2_000, "r")),
    ),
    (
        "upstream assets go with it",
        Need("k", "w", 0, None, upstream=("up",)),
        KeyRuns(),
        Verdict("k", Action.RELAUNCH, "w", 0, 1, upstream=("up",)),
    ),
]


@pytest.mark.parametrize(
    ("need", "runs", "expected"), [c[1:] for c in VERDICT_CASES], ids=[c[0] for c in VERDICT_CASES]
)
def test_verdict_for(need: Need, runs: KeyRuns, expected: Verdict) -> None:
    assert judge.verdict_for(need, runs, LIVES, JOB) == expected


def test_relaunch_canceled_relaunches_after_a_cancel() -> None:
    eager = dataclasses.replace(JOB, relaunch_canceled=True)
    verdict = judge.verdict_for(NEED, KeyRuns((Run("c", S.CANCELED),)), LIVES, eager)
    assert verdict.action is Action.RELAUNCH


def test_judge_keys_spends_the_request_budget_in_order_and_names_zombies() -> None:
    facts = [KeyFacts(k, lease("FAIL", key=k, idle_ms=10**7)) for k in ("a", "b", "c")] + [
        KeyFacts("d", lease(key="d", heartbeat_age_ms=10))
    ]
    runs = {"a": KeyRuns((Run("r-dead", S.STARTED),)), "b": KeyRuns(), "c": KeyRuns()}
    judgement = judge.judge_keys(facts, runs, LIVES, JOB, budget=2)
    assert [(v.key, v.action) for v in judgement.verdicts] == [
        ("a", Action.RELAUNCH),
        ("b", Action.RELAUNCH),
        ("c", Action.DEFERRED),
        ("d", Action.LIVE),
    ]
    assert judgement.zombies == {"r-dead": "its lease of k2 expired 60 s ago (attempt 1)"}


# ---- what a run's lease rows say of it ------------------------------------------------------------------

LIFE_CASES = [
    ("holds a live lease", [lease(heartbeat_age_ms=10)], Life(live=True, quiet_ms=0)),
    (
        "its lease expired",
        [lease(overdue_ms=61_000, idle_ms=70_000)],
        Life(live=False, dead="its lease expired 61 s ago (lease of k, attempt 2)", quiet_ms=70_000),
    ),
    (
        "one live lease outweighs a stale one (a live run heartbeats what it holds)",
        [lease(heartbeat_age_ms=5_000, key="old"), lease(heartbeat_age_ms=10, key="new")],
        Life(live=True, quiet_ms=0),
    ),
    (
        "holds nothing: quiet since its last finished key",
        [lease("SUCCESS", idle_ms=40_000), lease("FAIL", idle_ms=50_000)],
        Life(live=False, quiet_ms=40_000),
    ),
    ("holds nothing and never did: quiet since created", [], Life(live=False, quiet_ms=100_000)),
]


@pytest.mark.parametrize(("held", "expected"), [c[1:] for c in LIFE_CASES], ids=[c[0] for c in LIFE_CASES])
def test_life_of(held: list[LeaseFacts], expected: Life) -> None:
    assert judge.life_of(100_000, held, JOB) == expected


@pytest.mark.parametrize(
    ("status", "life", "zombie"),
    [
        (S.STARTED, None, False),
        (S.STARTED, Life(live=True), False),
        (S.STARTED, Life(live=False, dead="expired"), True),
        (S.STARTING, Life(live=False, quiet_ms=300_001), True),
        (S.STARTED, Life(live=False, quiet_ms=300_000), False),
        (S.QUEUED, Life(live=False, quiet_ms=10**9), False),  # queued is in flight, whatever its age
        (S.CANCELING, Life(live=False, dead="expired"), False),
        (S.FAILURE, Life(live=False, dead="expired"), False),
    ],
)
def test_zombie_reason(status: dg.DagsterRunStatus, life: Life | None, zombie: bool) -> None:
    assert (judge.zombie_reason(status, life, JOB) is not None) is zombie


@pytest.mark.parametrize(
    ("row", "materialized", "policy", "run_id", "step_undone", "undone"),
    [
        (None, None, JOB, "r", False, True),
        (lease("FAIL"), None, JOB, "r", False, True),
        (lease(heartbeat_age_ms=10), None, JOB, "r", False, False),
        (lease(overdue_ms=1), None, JOB, "r", False, True),
        (lease(heartbeat_age_ms=3_500), None, JOB, "r", False, False),  # stale is not dead (#35 item 3)
        (lease(heartbeat_age_ms=4_500), None, JOB, "r", False, True),
        (lease("SUCCESS"), False, ASSET, HOLDER_RUN, False, True),  # done, but not recorded here
        (lease("SUCCESS"), True, ASSET, "r", False, False),
        (lease("SUCCESS"), None, JOB, "r", True, True),  # its leased step failed held: another run did it
        (lease("SUCCESS"), None, JOB, "r", False, False),  # its leased step never ran: done by another
        (lease("SUCCESS"), None, JOB, HOLDER_RUN, True, False),  # this run did it
    ],
)
def test_left_undone(
    row: LeaseFacts | None,
    materialized: bool | None,
    policy: Policy,
    run_id: str,
    step_undone: bool,
    undone: bool,
) -> None:
    assert judge.left_undone(row, materialized, policy, run_id, step_undone) is undone


@pytest.mark.parametrize(
    ("relaunches", "wait"), [(0, 0), (1, 60_000), (2, 120_000), (3, 240_000), (5, 600_000), (30, 600_000)]
)
def test_backoff_doubles_up_to_its_cap(relaunches: int, wait: int) -> None:
    assert judge.relaunch_backoff_ms(relaunches, 60_000, 600_000) == wait


# -- facts' pure parts (dagster_joblease.dagster.reconcile.facts) --------------------------------------


def _run(run_id: str, status: dg.DagsterRunStatus) -> dg.DagsterRun:
    return dg.DagsterRun(job_name="j", run_id=run_id, status=status)


FAILED_A = _run("a", dg.DagsterRunStatus.FAILURE)
STARTED_B = _run("b", dg.DagsterRunStatus.STARTED)
STARTING_C = _run("c", dg.DagsterRunStatus.STARTING)
RELAUNCH_D, RELAUNCH_E = _run("d", dg.DagsterRunStatus.SUCCESS), _run("e", dg.DagsterRunStatus.FAILURE)


@pytest.mark.parametrize(
    ("singles", "covered", "launched", "wanted"),
    [
        ({"k1": [], "k2": []}, set(), {"k1": [], "k2": []}, []),
        ({"k1": [FAILED_A], "k2": []}, set(), {"k1": [], "k2": []}, []),  # finished, nothing to order among
        ({"k1": [STARTED_B, FAILED_A, STARTING_C], "k2": []}, set(), {"k1": [], "k2": []}, ["b", "c"]),
        ({"k1": [STARTED_B, FAILED_A], "k2": [STARTING_C]}, {"k1"}, {"k1": [], "k2": []}, ["b", "a", "c"]),
        (  # the last relaunch of each key (newest first), after the singles
            {"k1": [FAILED_A], "k2": []},
            set(),
            {"k1": [RELAUNCH_E, RELAUNCH_D], "k2": [RELAUNCH_D]},
            ["e", "d"],
        ),
    ],
)
def test_key_runs_reads_records_only_for_the_runs_that_need_them(
    singles: dict[str, list[dg.DagsterRun]],
    covered: set[str],
    launched: dict[str, list[dg.DagsterRun]],
    wanted: list[str],
) -> None:
    record = object()  # a range run's record: only whether a key has any counts here
    covering = {k: [record] if k in covered else [] for k in singles}
    assert records_wanted(list(singles), singles, covering, launched) == wanted  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("asset", "known", "found", "fact"),
    [
        (False, None, True, None),  # a job target: never said
        (False, True, True, None),
        (True, None, True, True),  # unknown to its source: this tick's read
        (True, None, False, False),
        (True, True, False, True),  # its source knew: kept
        (True, False, True, False),
    ],
)
def test_a_candidates_materialization_is_what_its_source_knew_else_what_was_read(
    asset: bool, known: bool | None, found: bool, fact: bool | None
) -> None:
    assert materialized_fact(known, found, dataclasses.replace(JOB, asset=asset)) is fact
