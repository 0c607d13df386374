"""The reconciliation judge: a pure function from what a tick read (facts) to what it should do (verdicts).

Nothing here reads a database or a Dagster instance; tests build the facts by hand (``tests/dagster/
test_reconcile_judge.py``, table-driven). A key is judged in two steps, because the second one needs the
key's runs, which are costly to look up and only needed for some keys:

1. :func:`need_of`, from the key's lease row and who named it (a lease-row sweep, a run of this deployment
   that left it undone, catch-up): the key is done, held by a live holder, to be recorded (a leased asset's
   key done by some run, with no materialization on this instance), or it *needs a run* (a :class:`Need`).
2. :func:`verdict_for`, from the key's runs: a key that needs a run is in flight (an unfinished run that is
   not a zombie covers it), left alone (its latest run was canceled by a person), capped, backing off, or
   relaunched.

Life comes from the lease, by one rule (:func:`dagster_joblease.staleness.holder_death`, which waiters
apply too): a holder is dead when its lease expired, its heartbeat has been missing for the failover
tolerance (four of its own intervals), or the run named on its lease is finished and its heartbeat stopped.
Zombies (:func:`zombie_reason`): a run Dagster still calls STARTING/STARTED is a zombie when it holds no
live lease (of any code) and a RUNNING lease it holds is dead by that rule, or, holding no lease at all,
when it has been quiet (since it started or since its last lease activity) for longer than it could be
waiting for a holder.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence

import dagster as dg

from dagster_joblease import staleness
from dagster_joblease.dagster import holders

__all__ = [
    "FINISHED",
    "RUNNING",
    "Action",
    "KeyFacts",
    "KeyRuns",
    "LeaseFacts",
    "Life",
    "Named",
    "Run",
    "Free",
    "Judgement",
    "Need",
    "Policy",
    "Verdict",
    "relaunch_backoff_ms",
    "judge_keys",
    "left_undone",
    "life_of",
    "need_of",
    "verdict_for",
    "zombie_reason",
]

# ---- facts: the judge's input (plain data) ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeaseFacts:
    """A lease row as reconciliation sees it; ages are on the database clock."""

    key: str
    status: str  #: RUNNING | FAIL | SUCCESS
    attempt: int
    holder: str | None = None
    overdue_ms: int = 0  #: > 0: the lease expired that long ago (by the holder's own length)
    heartbeat_age_ms: int = 0
    idle_ms: int = 0  #: since the last heartbeat or finish
    heartbeat_ms: int | None = 1_000  #: the holder's recorded interval (None: a row from before 0002)
    id: int = 0

    @property
    def holder_run_id(self) -> str | None:
        decoded = holders.decode_holder(self.holder)
        return None if decoded is None else decoded.run_id


@dataclasses.dataclass(frozen=True)
class Run:
    """A Dagster run of the target covering a key (a single partition or a range)."""

    run_id: str
    status: dg.DagsterRunStatus
    created_age_ms: int = 0
    ended_age_ms: int | None = None
    outcome: str | None = None  #: its ``joblease/outcome`` tag
    is_range: bool = False


@dataclasses.dataclass(frozen=True)
class Life:
    """What the lease table says of an unfinished run of this instance."""

    live: bool  #: it holds a RUNNING lease (of any code) whose holder is alive by the liveness rule
    dead: str | None = None  #: it holds a RUNNING lease whose holder is dead by the liveness rule: why
    quiet_ms: int = 0  #: since its last sign of life: its start, or its last lease activity


@dataclasses.dataclass(frozen=True)
class Named:
    """A run of this deployment that left a key undone (failed, died, or was canceled before it)."""

    run_id: str
    why: str
    upstream: tuple[str, ...] = ()  #: upstream assets of that run that did not finish the key either


@dataclasses.dataclass(frozen=True)
class KeyFacts:
    """Everything the judge's first step needs about one partition key."""

    key: str
    lease: LeaseFacts | None = None
    named: tuple[Named, ...] = ()
    catch_up: bool = False  #: from ``catch_up_from`` on and never attempted
    holder_status: dg.DagsterRunStatus | None = None  #: the lease holder's run on this instance
    holder_dead: bool = False  #: the holder's run here is a zombie
    materialized: bool | None = None  #: an asset: this instance has a materialization of the key


@dataclasses.dataclass(frozen=True)
class KeyRuns:
    """A key's runs (newest first), this sensor's relaunches of it (root runs it launched) and its attempts
    (those relaunches and Dagster's run retries of them; the last relaunch: the newest attempt)."""

    runs: tuple[Run, ...] = ()
    relaunches: int = 0
    attempts: int = 0
    last_relaunch: str | None = None
    last_relaunch_end_age_ms: int | None = None


# ---- verdicts ---------------------------------------------------------------------------------------------

#: Run statuses in which a run's worker may be executing (or dead without Dagster knowing: a zombie).
RUNNING = frozenset({dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED})
#: Run statuses after which a run's processes are done.
FINISHED = frozenset({dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED})


@dataclasses.dataclass(frozen=True)
class Policy:
    """The sensor's settings the judge applies (durations in milliseconds)."""

    cap: int = 5  #: attempts per key by this sensor: its relaunches and Dagster's run retries of them
    backoff_ms: int = 120_000  #: the second relaunch waits this long after the key's last activity
    max_backoff_ms: int = 3_600_000
    relaunch_canceled: bool = False
    may_wait_ms: int = 600_000  #: a run holding no lease may be waiting for a holder this long
    legacy_stale_ms: int = 120_000  #: staleness of rows from before migration 0002
    holder_stale_ms: int | None = None  #: may lengthen the holder's own staleness threshold, never shorten
    asset: bool = False  #: the target is an asset: done keys without a materialization here are recorded


class Action(enum.StrEnum):
    RELAUNCH = "relaunch"  #: request a run for the key
    RECORD = "record"  #: done by some run, no materialization here: record one pointing at the winner
    LIVE = "live"  #: a live holder has it
    IN_FLIGHT = "in-flight"  #: an unfinished run (not a zombie) covers it
    CANCELED = "canceled"  #: its latest run was canceled by a person (relaunch_canceled=False)
    CAPPED = "capped"  #: this sensor relaunched it max_relaunches times already
    BACKING_OFF = "backing-off"  #: the next relaunch waits
    DONE = "done"  #: nothing to do
    DEFERRED = "deferred"  #: would be relaunched, but this tick's request budget is spent
    GONE = "gone"  #: no longer a partition key of the target (a deleted dynamic partition): reported, passed


@dataclasses.dataclass(frozen=True)
class Free:
    """Fail a dead holder's RUNNING lease (fenced on its attempt and a stale heartbeat) before relaunching,
    so the relaunched run reclaims it at once instead of waiting for its expiry."""

    attempt: int
    stale_ms: int
    reason: str
    run_id: str | None = None  #: the holder's Dagster run (recorded ``lost`` once its lease is taken)


@dataclasses.dataclass(frozen=True)
class Need:
    """A key that needs a run, and what the relaunch carries."""

    key: str
    why: str
    attempt: int = 0  #: the lease's attempt (0: no lease row), part of the run key
    idle_ms: int | None = None  #: since the lease's last activity (the backoff counts from it)
    upstream: tuple[str, ...] = ()  #: upstream assets to run with it (they never finished the key)
    free: Free | None = None
    #: only while the key's latest run here ended undone (the lease is done elsewhere: a green run settles it)
    until_green: bool = False


@dataclasses.dataclass(frozen=True)
class Verdict:
    key: str
    action: Action
    why: str = ""
    attempt: int = 0
    relaunch: int = 0  #: RELAUNCH: which relaunch of the key this is (1-based)
    upstream: tuple[str, ...] = ()
    free: Free | None = None
    winner: str | None = None  #: RECORD: the run (or holder) that did the key


@dataclasses.dataclass
class Judgement:
    verdicts: list[Verdict] = dataclasses.field(default_factory=list)
    #: run id -> why: unfinished runs that are zombies
    zombies: dict[str, str] = dataclasses.field(default_factory=dict)

    def of(self, action: Action) -> list[Verdict]:
        return [v for v in self.verdicts if v.action is action]


def relaunch_backoff_ms(relaunches: int, base_ms: int, max_ms: int) -> int:
    """How long relaunch ``relaunches + 1`` waits after the key's last activity (the first: not at all)."""
    return 0 if relaunches == 0 else min(max_ms, base_ms * 2 ** (relaunches - 1))


def _death(lease: LeaseFacts, policy: Policy, run_finished: str | None = None) -> staleness.Death | None:
    """Why a lease's holder is dead by the liveness rule (:func:`staleness.holder_death`), ``run_finished``
    saying what proves the run named on it finished; None while it is alive."""
    return staleness.holder_death(
        status=lease.status,
        overdue_ms=lease.overdue_ms,
        heartbeat_age_ms=lease.heartbeat_age_ms,
        heartbeat_ms=lease.heartbeat_ms,
        run_finished=run_finished,
        legacy_ms=policy.legacy_stale_ms,
        at_least_ms=policy.holder_stale_ms,
    )


def _death_text(lease: LeaseFacts, death: staleness.Death) -> str:
    return f"{death.why} (lease of {lease.key}, attempt {lease.attempt})"


def life_of(started_age_ms: int, held: Iterable[LeaseFacts], policy: Policy) -> Life:
    """What the lease rows a run holds (``held``: rows of any status whose holder is the run) say of it."""
    live = False
    dead: str | None = None
    quiet = started_age_ms
    for lease in held:
        quiet = min(quiet, lease.idle_ms)
        if lease.status != "RUNNING":
            continue
        death = _death(lease, policy)
        if death is None:
            live = True
        elif dead is None:
            dead = _death_text(lease, death)
    return Life(live=live, dead=None if live else dead, quiet_ms=quiet)


def zombie_reason(status: dg.DagsterRunStatus, life: Life | None, policy: Policy) -> str | None:
    """Why an unfinished run of this instance is a zombie, or None (not one: in flight, or finished)."""
    if status not in RUNNING or life is None or life.live:
        return None
    if life.dead:
        return life.dead
    if life.quiet_ms > policy.may_wait_ms:
        return (
            f"it holds no lease {life.quiet_ms // 1000} s after it started or last held one "
            f"(it could wait for a holder {policy.may_wait_ms // 1000} s)"
        )
    return None


def left_undone(
    lease: LeaseFacts | None, materialized: bool | None, policy: Policy, run_id: str, step_undone: bool
) -> bool:
    """Did run ``run_id``, which covered this key, leave it undone (as the walk over unsettled runs asks)?
    From the key's own facts only, never the run's outcome tag (a summary for people).

    No row, a FAIL row, or a RUNNING row whose holder is dead by the lease alone: yes. A SUCCESS row: for
    an asset, when this instance has no materialization of the key; for a job, when another run did it
    and this run's leased step of the code ended undone (``step_undone``: it failed ``held``, so the run is
    red on it: a green run settles it). A run whose leased step never ran left a done key done.
    """
    if lease is None or lease.status == "FAIL":
        return True
    if lease.status == "RUNNING":
        return _death(lease, policy) is not None
    if policy.asset:
        return materialized is False
    return lease.holder_run_id != run_id and step_undone


def _upstream(facts: KeyFacts) -> tuple[str, ...]:
    return tuple(sorted({asset for named in facts.named for asset in named.upstream}))


def _named_why(facts: KeyFacts) -> str:
    first = facts.named[0]
    more = f" (and {len(facts.named) - 1} more runs)" if len(facts.named) > 1 else ""
    return first.why + more


def _done(facts: KeyFacts, lease: LeaseFacts, policy: Policy) -> Verdict | Need:
    """A key whose lease is SUCCESS: done. Recorded here if it is an asset this instance has no
    materialization of and this deployment asked for it (a run here left it undone, or its holder's run
    here ended or died); for a job, relaunched while its latest run here ended undone (it will skip)."""
    asked = bool(facts.named) or facts.holder_status in FINISHED or facts.holder_dead
    if policy.asset:
        if facts.materialized is False and asked:
            return Verdict(
                facts.key,
                Action.RECORD,
                "done, no materialization here",
                lease.attempt,
                winner=lease.holder_run_id or lease.holder,
            )
        return Verdict(facts.key, Action.DONE, "lease SUCCESS")
    if facts.named:
        return Need(
            facts.key,
            f"{_named_why(facts)}; done by {lease.holder}",
            lease.attempt,
            lease.idle_ms,
            until_green=True,
        )
    return Verdict(facts.key, Action.DONE, "lease SUCCESS")


def _running(facts: KeyFacts, lease: LeaseFacts, policy: Policy) -> Verdict | Need:
    finished = f"its run here is {facts.holder_status.value}" if facts.holder_status in FINISHED else None
    death = _death(lease, policy, finished)
    if death is None:
        return Verdict(facts.key, Action.LIVE, f"held by {lease.holder}")
    if death.fence_ms is None:
        return Need(facts.key, "lease expired", lease.attempt, lease.idle_ms, _upstream(facts))
    if facts.holder_status in RUNNING:
        why = f"zombie holder {lease.holder}"
    else:  # finished here, or not a run of this instance: the lease alone says it is dead
        why = f"dead holder {lease.holder}"
    free = Free(lease.attempt, death.fence_ms, f"{why}: {_death_text(lease, death)}", lease.holder_run_id)
    return Need(facts.key, why, lease.attempt, lease.idle_ms, _upstream(facts), free)


def need_of(facts: KeyFacts, policy: Policy) -> Verdict | Need:
    """Step 1: what the key's lease row (and who named it) says; a :class:`Need` when it needs a run."""
    lease = facts.lease
    if lease is None:
        if facts.named:
            return Need(facts.key, _named_why(facts), 0, None, _upstream(facts))
        if facts.catch_up:
            return Need(facts.key, "never attempted (catch-up)")
        return Verdict(facts.key, Action.DONE, "no lease row and nothing names it")
    if lease.status == "SUCCESS":
        return _done(facts, lease, policy)
    if lease.status == "FAIL":
        return Need(facts.key, "lease FAIL", lease.attempt, lease.idle_ms, _upstream(facts))
    return _running(facts, lease, policy)


def zombies_among(runs: Iterable[Run], lives: Mapping[str, Life], policy: Policy) -> dict[str, str]:
    """The unfinished runs among ``runs`` that are zombies: run id -> why."""
    found: dict[str, str] = {}
    for run in runs:
        why = zombie_reason(run.status, lives.get(run.run_id), policy)
        if why is not None:
            found[run.run_id] = why
    return found


def verdict_for(need: Need, runs: KeyRuns, lives: Mapping[str, Life], policy: Policy) -> Verdict:
    """Step 2: a key that needs a run, judged with its runs (newest first) and this sensor's relaunches."""
    key = need.key
    zombies = zombies_among(runs.runs, lives, policy)
    for run in runs.runs:
        if run.status not in FINISHED and run.run_id not in zombies:
            return Verdict(key, Action.IN_FLIGHT, f"run {run.run_id} is {run.status.value}")
    latest = runs.runs[0] if runs.runs else None
    if need.until_green and (latest is None or latest.status == dg.DagsterRunStatus.SUCCESS):
        return Verdict(key, Action.DONE, "a later run settled it")
    if latest is not None and latest.status == dg.DagsterRunStatus.CANCELED and not policy.relaunch_canceled:
        return Verdict(key, Action.CANCELED, f"run {latest.run_id} was canceled")
    done = runs.relaunches
    tried = max(done, runs.attempts)
    if tried >= policy.cap:
        counted = (
            f"{done} relaunches" if tried == done else f"{tried} attempts ({done} relaunches and run retries)"
        )
        return Verdict(key, Action.CAPPED, f"{counted} ({need.why}); last run {runs.last_relaunch}")
    idle = need.idle_ms if need.idle_ms is not None else runs.last_relaunch_end_age_ms
    wait = relaunch_backoff_ms(done, policy.backoff_ms, policy.max_backoff_ms)
    if idle is not None and idle < wait:
        return Verdict(key, Action.BACKING_OFF, f"relaunch {done + 1} in {(wait - idle) / 1000:.0f} s")
    return Verdict(key, Action.RELAUNCH, need.why, need.attempt, done + 1, need.upstream, need.free)


def judge_keys(
    facts: Sequence[KeyFacts],
    runs: Mapping[str, KeyRuns],
    lives: Mapping[str, Life],
    policy: Policy,
    budget: int,
) -> Judgement:
    """Every key's verdict, in order; at most ``budget`` relaunches (the rest: DEFERRED).

    ``runs`` has the runs of each key that needs a run (:func:`need_of` returns a :class:`Need`); ``lives``
    what the lease table says of each unfinished run among them.
    """
    judgement = Judgement()
    relaunches = 0
    for key_facts in facts:
        need = need_of(key_facts, policy)
        if isinstance(need, Verdict):
            judgement.verdicts.append(need)
            continue
        if relaunches >= budget:
            judgement.verdicts.append(Verdict(need.key, Action.DEFERRED, need.why))
            continue
        key_runs = runs.get(need.key, KeyRuns())
        judgement.zombies.update(zombies_among(key_runs.runs, lives, policy))
        verdict = verdict_for(need, key_runs, lives, policy)
        relaunches += verdict.action is Action.RELAUNCH
        judgement.verdicts.append(verdict)
    return judgement
