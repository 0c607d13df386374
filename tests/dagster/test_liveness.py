"""The liveness rule (#35): one function (``staleness.holder_death``), and every judge says what it says.

One table: a lease row (its holder's own interval: 2 s; lease 30 s) and what Dagster says of the run named
on it. Each row is put to the rule itself, to a waiting run (``waiting.death_of``, what the wait engine
applies before taking a lease over) and to the reconciliation judge (``need_of`` for the key, ``life_of``
for the run that holds it): all agree on alive or dead.
"""

from __future__ import annotations

import dagster as dg
import pytest

from dagster_joblease import staleness, waiting
from dagster_joblease.dagster.reconcile import judge
from dagster_joblease.dagster.reconcile.judge import Action, KeyFacts, LeaseFacts, Policy

S = dg.DagsterRunStatus
HOLDER = "dagster:prod/0c1f2d3e-1111-2222-3333-444455556666"
POLICY = Policy(legacy_stale_ms=10_000)
BEAT = 2_000

# (case, heartbeat age ms, overdue ms, holder's interval, the run's status here (None: not here), dead)
RULE = [
    ("fresh", 500, 0, BEAT, S.STARTED, False),
    ("one beat late", 3_000, 0, BEAT, S.STARTED, False),
    ("a 7 s database blip while STARTED (#35 item 3): stale is not dead", 7_000, 0, BEAT, S.STARTED, False),
    ("exactly 4 intervals: not yet", 8_000, 0, BEAT, S.STARTED, False),
    (
        "4 intervals missed while STARTED (a SIGKILLed worker, monitoring off)",
        8_001,
        0,
        BEAT,
        S.STARTED,
        True,
    ),
    ("4 intervals missed, its run not on this instance", 8_001, 0, BEAT, None, True),
    (
        "4 intervals missed, its run QUEUED (not its run: a stray holder label)",
        8_001,
        0,
        BEAT,
        S.QUEUED,
        True,
    ),
    ("its run finished, heartbeat fresh: a surviving step process", 500, 0, BEAT, S.CANCELED, False),
    ("its run finished, 2 intervals: not yet", 4_000, 0, BEAT, S.FAILURE, False),
    ("its run finished and its heartbeat stopped", 4_001, 0, BEAT, S.FAILURE, True),
    ("its run SUCCESS while the lease is RUNNING", 4_001, 0, BEAT, S.SUCCESS, True),
    ("its lease expired, whatever the run", 0, 1, BEAT, S.STARTED, True),
    ("never heartbeats: only expiry", 10**9, 0, 0, S.FAILURE, False),
    ("never heartbeats, expired", 10**9, 5, 0, S.STARTED, True),
    ("a pre-0002 row: the judge's old rule, 4/2 of it", 20_001, 0, None, None, True),
    ("a pre-0002 row under it", 20_000, 0, None, S.STARTED, False),
]


def _finished(status: dg.DagsterRunStatus | None) -> str | None:
    return f"its Dagster run is {status.value}" if status in judge.FINISHED else None


@pytest.mark.parametrize(
    ("age_ms", "overdue_ms", "beat_ms", "run", "dead"), [c[1:] for c in RULE], ids=[c[0] for c in RULE]
)
def test_every_judge_applies_one_liveness_rule(
    age_ms: int, overdue_ms: int, beat_ms: int | None, run: dg.DagsterRunStatus | None, dead: bool
) -> None:
    death = staleness.holder_death(
        status="RUNNING",
        overdue_ms=overdue_ms,
        heartbeat_age_ms=age_ms,
        heartbeat_ms=beat_ms,
        run_finished=_finished(run),
        legacy_ms=POLICY.legacy_stale_ms,
    )
    assert (death is not None) is dead

    row = waiting.Row("RUNNING", 1, "t" * 32, HOLDER, age_ms, -overdue_ms, beat_ms)
    assert (waiting.death_of(row, _finished(run), POLICY.legacy_stale_ms) is not None) is dead

    lease = LeaseFacts("k", "RUNNING", 1, HOLDER, overdue_ms, age_ms, age_ms, beat_ms)
    verdict = judge.need_of(KeyFacts("k", lease, holder_status=run), POLICY)
    assert (getattr(verdict, "action", None) is not Action.LIVE) is dead
    if run not in judge.FINISHED:  # the run that holds it, as the judge of zombies sees it
        assert judge.life_of(0, [lease], POLICY).live is not dead


def test_the_failover_tolerance_is_at_least_what_the_operations_guide_promises() -> None:
    assert staleness.FAILOVER_HEARTBEATS >= 4
    assert staleness.dead_after_ms(10_000, legacy_ms=0) == 40_000
    assert staleness.dead_after_ms(10_000, legacy_ms=0, at_least_ms=60_000) == 60_000  # only longer
    assert staleness.dead_after_ms(10_000, legacy_ms=0, at_least_ms=1_000) == 40_000
    assert staleness.dead_after_ms(0, legacy_ms=5_000) is None
