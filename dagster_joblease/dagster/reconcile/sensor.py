"""The reconciliation sensor: read the facts, let the judge decide, turn the verdicts into run requests.

:func:`build_reconciliation_sensor` validates its settings once; each tick (:class:`_Tick`) reads the
sources in order (the lease rows, the runs this deployment left undone, catch-up), judges the named keys a
page at a time until the request budget or the time budget is spent, acts on the verdicts (frees a dead
holder's lease, says which runs are zombies, records done keys, rewrites copied tags of re-executions
whose leased step never ran) and returns the requests with a cursor saying where every source resumes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import time
from collections.abc import Sequence
from typing import Any

import dagster as dg

from dagster_joblease import checks, errors, identity, lease
from dagster_joblease.dagster import metadata, run_status
from dagster_joblease.dagster.jobs import OutboxHealth
from dagster_joblease.dagster.reconcile import facts, judge
from dagster_joblease.dagster.reconcile.judge import Action, Verdict
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.dagster.sensors import db_clock
from dagster_joblease.storage import leases

__all__ = ["build_reconciliation_sensor"]

#: The most recently active lease rows read first, every tick.
RECENT_ROWS_PER_TICK = 200
#: Older rows read per tick by the sweep, continuing from the cursor.
SWEEP_ROWS_PER_TICK = 1_000
#: Keys of unsettled runs looked at per tick (keys they finished are filtered before they count).
WALK_KEYS_PER_TICK = 20_000
#: Keys the walk names (left undone) per tick at most; the next tick resumes at the first not judged.
WALK_NAMED_PER_TICK = 1_000
#: Done keys recorded (a materialization pointing at the winner) per tick at most.
RECORDS_PER_TICK = 1_000
#: A tick stops judging after this long and resumes there next tick (Dagster's sensor timeout: 60 s).
TICK_BUDGET_S = 20.0
SHOWN_IN_CURSOR = 50
SHOWN_IN_MESSAGE = 10


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What :func:`build_reconciliation_sensor` was given, validated."""

    target: facts.Target
    code: str
    sensor_name: str
    lookback: dt.timedelta
    catch_up_from: str | None
    max_requests: int
    cap: int
    backoff_ms: int
    max_backoff_ms: int
    relaunch_canceled: bool
    holder_stale_ms: int | None
    margin_ms: int
    health: OutboxHealth | None
    checks_every: int
    resource_key: str

    def policy(self, resource: JobLeaseResource) -> judge.Policy:
        timing = resource.timing()
        return judge.Policy(
            cap=self.cap,
            backoff_ms=self.backoff_ms,
            max_backoff_ms=self.max_backoff_ms,
            relaunch_canceled=self.relaunch_canceled,
            may_wait_ms=resource.resolved_held_wait_ms() + self.margin_ms,
            legacy_stale_ms=self.holder_stale_ms or 2 * (timing.heartbeat_ms or timing.lease_ms),
            holder_stale_ms=self.holder_stale_ms,
            asset=self.target.asset_key is not None,
        )


@dataclasses.dataclass
class _Sweep:
    """The lease-row sweep's bookkeeping: which swept rows were named, and how many rows follow them."""

    after: int
    rows: list[tuple[str, int]] = dataclasses.field(default_factory=list)  #: (key, row id), in id order
    remaining: int = 0


class _Tick:
    """One evaluation: read, judge a page at a time, act, and say what is left."""

    def __init__(self, context: dg.SensorEvaluationContext, settings: _Settings) -> None:
        self.context = context
        self.settings = settings
        self.started = time.monotonic()
        self.resource: JobLeaseResource = getattr(context.resources, settings.resource_key)
        self.instance = context.instance
        self.cursor: dict[str, Any] = json.loads(context.cursor) if context.cursor else {}
        self.policy = settings.policy(self.resource)
        self.now = db_clock(self.resource.engine)
        self.since = dt.datetime.now(dt.UTC) - settings.lookback  # Dagster's timestamps: the host's clock
        settings.target.bind(context.repository_def)
        self.reader = facts.Reader(self.resource.engine, self.instance, settings.code, settings.target)
        self.candidates: dict[str, facts.Candidate] = {}
        self.judgement = judge.Judgement()
        self.judged: set[str] = set()
        self.out_of_time = False
        self.freed: dict[str, str] = {}  #: run id -> why: dead holders whose lease this tick took
        self._ranges: facts.RangeIndex | None = None
        #: keys no longer partitions that earlier ticks reported (logged once; the message still counts them)
        self.reported_gone: set[str] = set(self.cursor.get("gone", []))

    # -- sources --------------------------------------------------------------------------------------

    def _add(self, candidate: facts.Candidate) -> None:
        known = self.candidates.get(candidate.key)
        if known is None:
            self.candidates[candidate.key] = candidate
            return
        known.named += candidate.named
        known.catch_up = known.catch_up or candidate.catch_up
        if candidate.lease_known and not known.lease_known:
            known.lease, known.lease_known = candidate.lease, True
        if known.materialized is None:
            known.materialized = candidate.materialized

    def read_leases(self) -> _Sweep:
        """The most recently active rows (a new failure is seen in one tick), then the sweep's next page."""
        statuses = ["FAIL", "RUNNING", "SUCCESS"] if self.policy.asset else ["FAIL", "RUNNING"]
        sweep = _Sweep(int(self.cursor.get("sweep_after", 0)))
        page = self.reader.read(
            lambda conn: leases.reconcile_page(
                conn,
                self.settings.code,
                lookback_ms=int(self.settings.lookback.total_seconds() * 1000),
                statuses=statuses,
                sweep_after=sweep.after,
                recent=RECENT_ROWS_PER_TICK,
                sweep=SWEEP_ROWS_PER_TICK,
            )
        )
        for state in [*page.recent, *page.sweep]:
            row = facts.lease_of(state)
            self.reader.remember([row])
            self._add(facts.Candidate(row.key, row, lease_known=True))
        sweep.rows = [(s.run_key, s.id) for s in page.sweep]
        sweep.remaining = page.after
        return sweep

    def walk(self) -> facts.Walk:
        """The runs of this deployment that left keys undone, from the cursor's position."""
        walker = facts.Walker(
            self.reader, self.policy, self.since, keys=WALK_KEYS_PER_TICK, named=WALK_NAMED_PER_TICK
        )
        walk = walker.run(facts.Position.from_json(self.cursor.get("walk")))
        for key, (named, row, materialized, _position) in walk.named.items():
            self._add(facts.Candidate(key, row, True, (named,), materialized=materialized))
        self.judgement.zombies.update(walk.zombies)
        return walk

    # -- judging ----------------------------------------------------------------------------------------

    def ranges(self) -> facts.RangeIndex:
        if self._ranges is None:
            self._ranges = facts.RangeIndex(self.reader, self.since)
        return self._ranges

    def requests_left(self) -> int:
        return self.settings.max_requests - len(self.judgement.of(Action.RELAUNCH))

    def judge(self, keys: Sequence[str]) -> None:
        """Judge ``keys`` a page at a time; once the time budget is spent the rest stay unjudged."""
        with dg.partition_loading_context(effective_dt=self.now, dynamic_partitions_store=self.instance):
            fresh = [k for k in keys if k not in self.judged]
            valid = [k for k in fresh if self.settings.target.partitions_def.has_partition_key(k)]
        for key in sorted(set(fresh) - set(valid)):  # judged (reported, passed): every cursor moves past it
            self.judgement.verdicts.append(
                Verdict(key, Action.GONE, f"no longer a partition of {self.settings.target.label}")
            )
            self.judged.add(key)
            if key not in self.reported_gone and len(self.judgement.of(Action.GONE)) <= SHOWN_IN_MESSAGE:
                self.context.log.warning(
                    f"key {key!r} of code {self.settings.code!r} is no longer a partition of "
                    f"{self.settings.target.label} (a deleted dynamic partition?); passed, not relaunched"
                )
        for offset in range(0, len(valid), facts.KEYS_PER_RUN_QUERY):
            if time.monotonic() - self.started > TICK_BUDGET_S:
                self.out_of_time = True
                return
            page = [self.candidates[k] for k in valid[offset : offset + facts.KEYS_PER_RUN_QUERY]]
            key_facts = facts.key_facts(self.reader, self.policy, page)
            left = self.requests_left()
            needing = [f.key for f in key_facts if isinstance(judge.need_of(f, self.policy), judge.Need)]
            runs, lives = (
                facts.key_runs(self.reader, self.ranges(), needing, self.settings.sensor_name, self.policy)
                if needing and left > 0
                else ({}, {})
            )
            page_judgement = judge.judge_keys(key_facts, runs, lives, self.policy, left)
            self.judgement.verdicts += page_judgement.verdicts
            self.judgement.zombies.update(page_judgement.zombies)
            self.judged.update(f.key for f in key_facts)

    def catch_up(self) -> int:
        """Never-attempted keys from ``catch_up_from`` on, oldest first, from the cursor, judged a batch at a
        time while requests are left (keys in flight do not use the budget); where the next tick resumes."""
        start = self.settings.catch_up_from
        offset = int(self.cursor.get("catch_up", 0))
        while start is not None and not self.out_of_time and self.requests_left() > 0:
            want = self.requests_left()
            with dg.partition_loading_context(effective_dt=self.now, dynamic_partitions_store=self.instance):
                keys, found = facts.catch_up(self.reader, start, offset, want, set(self.candidates))
            for key in keys:
                self._add(facts.Candidate(key, None, True, catch_up=True))
            self.judge(keys)
            waiting = {v.key for v in self.judgement.of(Action.DEFERRED)}
            for key, position in zip(keys, found, strict=True):
                if key not in self.judged or key in waiting:
                    return position
            if len(keys) < want:
                return 0  # the end of the keys: the next tick starts over from catch_up_from
            offset = found[-1] + 1
        return offset

    # -- acting -----------------------------------------------------------------------------------------

    def free_dead_holders(self) -> None:
        """Fail each dead holder's lease (fenced: still RUNNING at the attempt read, heartbeat still stale)
        before its key is relaunched; a holder that renewed in between keeps it, and its key is live."""
        service = lease.LeaseService(self.resource.engine)
        for i, verdict in enumerate(self.judgement.verdicts):
            if verdict.action is not Action.RELAUNCH or verdict.free is None:
                continue
            free = verdict.free
            job = identity.JobIdentity.schedule(self.settings.code, verdict.key)
            if not service.fail_dead_holder(
                job, attempt=free.attempt, stale_ms=free.stale_ms, reason=free.reason
            ):
                self.judgement.verdicts[i] = Verdict(
                    verdict.key, Action.LIVE, "its holder renewed or moved on"
                )
            elif free.run_id is not None:
                self.freed[free.run_id] = free.reason

    def tag_lost(self) -> None:
        """Zombie runs, and dead holders whose lease was taken while they still said ``pending``, say
        ``lost``: such a run cannot record its own end."""
        for run_id, why in {**self.freed, **self.judgement.zombies}.items():
            run = self.instance.get_run_by_id(run_id)
            if run is None or run.tags.get(metadata.TAG_OUTCOME) == metadata.LOST:
                continue
            zombie = run_id in self.judgement.zombies
            if not zombie and run.tags.get(metadata.TAG_OUTCOME) not in (None, metadata.PENDING):
                continue  # it recorded its own outcome
            self.instance.add_run_tags(run_id, metadata.run_tags({metadata.LOST: 1}, None))
            self.context.log.warning(
                f"run {run_id} is a zombie: Dagster still calls it {run.status.value} but {why}; tagged lost "
                "(enable run monitoring to have Dagster fail such runs)"
                if zombie
                else f"run {run_id} ({run.status.value}) died holding a lease ({why}); tagged lost"
            )

    def records(self) -> list[dg.AssetMaterialization]:
        asset_key = self.settings.target.asset_key
        recorded = self.judgement.of(Action.RECORD)[:RECORDS_PER_TICK]
        if asset_key is None or not recorded:
            return []
        here = self.reader.runs([v.winner for v in recorded if v.winner])
        return [
            dg.AssetMaterialization(
                asset_key=asset_key,
                partition=v.key,
                description=(
                    f"recorded by {self.settings.sensor_name}: the lease of {v.key} is SUCCESS (attempt "
                    f"{v.attempt}), done by {v.winner}, and this instance had no materialization of it"
                ),
                metadata={
                    metadata.META_WINNER: (
                        dg.MetadataValue.dagster_run(v.winner)
                        if v.winner in here
                        else dg.MetadataValue.text(v.winner or metadata.NONE)
                    ),
                    metadata.META_ATTEMPT: dg.MetadataValue.int(v.attempt),
                    metadata.META_OUTCOME: dg.MetadataValue.text("recorded-by-reconciliation"),
                },
            )
            for v in recorded
        ]

    def rewrite_not_run(self) -> dict[str, str]:
        """Re-executions of the target whose leased step never ran keep no outcome copied from a parent."""
        runs, cursors = facts.finished_reexecutions(self.reader, self.cursor.get("finished", {}), self.since)
        for run in runs:
            tags = run_status.not_run_tags_for(self.instance, run)
            if tags is not None:
                self.instance.add_run_tags(run.run_id, tags)
                self.context.log.info(
                    f"run {run.run_id} ({run.status.value}): its leased step never ran; joblease tags copied "
                    f"from its parent rewritten to {tags[metadata.TAG_OUTCOME]}"
                )
        return cursors

    def request(self, verdict: Verdict) -> dg.RunRequest:
        asset_key = self.settings.target.asset_key
        selection = None
        if asset_key is not None:
            selection = [*(dg.AssetKey.from_user_string(a) for a in verdict.upstream), asset_key]
        return dg.RunRequest(
            run_key=(
                f"reconcile:{self.settings.code}:{verdict.key}:attempt-{verdict.attempt}:"
                f"relaunch-{verdict.relaunch}"
            ),
            partition_key=verdict.key,
            asset_selection=selection,
            tags={
                metadata.TAG_OUTCOME: metadata.PENDING,
                metadata.TAG_RELAUNCH: f"{verdict.relaunch}/{self.settings.cap}",
                metadata.TAG_RECONCILE_REASON: metadata.bound_tag_text(
                    verdict.why
                    + (f" (with upstream {', '.join(verdict.upstream)})" if verdict.upstream else "")
                ),
            },
        )

    # -- the cursor ---------------------------------------------------------------------------------------

    def _resume(self, sweep: _Sweep) -> tuple[int, int]:
        """The sweep resumes before the first swept row not judged (or deferred)."""
        waiting = {v.key for v in self.judgement.of(Action.DEFERRED)}
        unjudged = [rid for key, rid in sweep.rows if key not in self.judged or key in waiting]
        unjudged = [rid for key, rid in sweep.rows if key in self.candidates and rid in unjudged]
        if unjudged:
            after = min(unjudged) - 1
            return after, sweep.remaining + sum(1 for _, rid in sweep.rows if rid > after)
        if sweep.rows and sweep.remaining:
            return sweep.rows[-1][1], sweep.remaining
        return 0, 0  # the sweep reached the end: the next tick starts over from the oldest row

    def _walk_resume(self, walk: facts.Walk) -> facts.Position:
        """The walk resumes at the first key it named that was not judged (or was deferred)."""
        waiting = {v.key for v in self.judgement.of(Action.DEFERRED)}
        for key, (_named, _row, _materialized, position) in walk.named.items():
            if key not in self.judged or key in waiting:
                return position
        return walk.end

    # -- the tick -----------------------------------------------------------------------------------------

    def evaluate(self) -> dg.SensorResult:
        sweep = self.read_leases()
        walk = self.walk()
        self.judge(list(self.candidates))
        catch_up_at = self.catch_up()
        self.free_dead_holders()
        self.tag_lost()
        events: list[Any] = self.records()
        finished = self.rewrite_not_run()
        sweep_after, remaining = self._resume(sweep)
        checks_at = float(self.cursor.get("checks_at", 0))
        health = self.settings.health
        if health is not None and self.now.timestamp() - checks_at >= self.settings.checks_every:
            events.extend(health.evaluate(self.resource.engine))
            checks_at = self.now.timestamp()
        capped = {v.key: v.why for v in self.judgement.of(Action.CAPPED)}
        new_cursor = {
            "checks_at": checks_at,
            "sweep_after": sweep_after,
            "walk": self._walk_resume(walk).to_json(),
            "catch_up": catch_up_at,
            "finished": finished,
            "capped": dict(sorted(capped.items())[:SHOWN_IN_CURSOR]),
            "capped_count": len(capped),
            "gone": sorted(self.reported_gone | {v.key for v in self.judgement.of(Action.GONE)})[
                :SHOWN_IN_CURSOR
            ],
        }
        requests = [self.request(v) for v in self.judgement.of(Action.RELAUNCH)]
        message = _message(self.judgement, self.settings, remaining, walk, self.out_of_time)
        self._log(requests, capped, message)
        return dg.SensorResult(
            run_requests=requests,
            skip_reason=None if requests else dg.SkipReason(message),
            asset_events=events,
            cursor=json.dumps(new_cursor, sort_keys=True),
        )

    def _log(self, requests: Sequence[dg.RunRequest], capped: dict[str, str], message: str) -> None:
        """Log lines are bounded like the rest of the tick: the first few, then how many more."""
        log = self.context.log
        for request in requests[:SHOWN_IN_MESSAGE]:
            log.info(
                f"relaunching {request.partition_key} ({request.tags[metadata.TAG_RECONCILE_REASON]}), "
                f"relaunch {request.tags[metadata.TAG_RELAUNCH]}"
            )
        if len(requests) > SHOWN_IN_MESSAGE:
            log.info(f"... and {len(requests) - SHOWN_IN_MESSAGE} more relaunches")
        for key, why in sorted(capped.items())[:SHOWN_IN_MESSAGE]:
            log.warning(
                f"partition {key} of code {self.settings.code!r} is still undone after {why}; relaunch cap "
                f"{self.settings.cap} reached: fix the cause, then launch it by hand (or `joblease leases "
                "fail` and raise the cap)"
            )
        if len(capped) > SHOWN_IN_MESSAGE:
            log.warning(
                f"... and {len(capped) - SHOWN_IN_MESSAGE} more partitions at the relaunch cap (the first "
                "are in the sensor cursor)"
            )
        if requests:  # a tick with requests has no skip message: the summary goes to the log
            log.info(message)


def _listed(verdicts: Sequence[Verdict], with_why: bool = True) -> str:
    shown = sorted(verdicts, key=lambda v: v.key)[:SHOWN_IN_MESSAGE]
    text = ", ".join(f"{v.key} ({v.why})" if with_why else v.key for v in shown)
    return text + (
        f" and {len(verdicts) - SHOWN_IN_MESSAGE} more" if len(verdicts) > SHOWN_IN_MESSAGE else ""
    )


def _message(
    judgement: judge.Judgement, settings: _Settings, remaining: int, walk: facts.Walk, out_of_time: bool
) -> str:
    """The tick's summary: what it did, what it left alone and why, and what is still to look at."""
    parts = [f"{len(judgement.of(Action.RELAUNCH))} relaunched"]
    listed = (
        (Action.CAPPED, f"CAPPED after {settings.cap} relaunches: ", True),
        (Action.BACKING_OFF, "backing off: ", True),
        (Action.CANCELED, "latest run canceled, not relaunched (relaunch_canceled=False): ", False),
        (Action.IN_FLIGHT, "a run is already queued or running: ", False),
    )
    for action, label, with_why in listed:
        if judgement.of(action):
            parts.append(label + _listed(judgement.of(action), with_why))
    if judgement.zombies:
        parts.append(f"{len(judgement.zombies)} zombie run(s) (STARTED without a live lease) tagged lost")
    recorded = len(judgement.of(Action.RECORD))
    if recorded:
        parts.append(
            f"recorded {min(recorded, RECORDS_PER_TICK)} done partition(s) that had no materialization"
        )
    deferred = len(judgement.of(Action.DEFERRED)) + max(0, recorded - RECORDS_PER_TICK)
    if deferred:
        parts.append(f"{deferred} more next tick (max_requests_per_tick={settings.max_requests})")
    gone = judgement.of(Action.GONE)
    if gone:
        parts.append("no longer a partition, passed: " + _listed(gone, with_why=False))
    live = len(judgement.of(Action.LIVE))
    if live:
        parts.append(f"{live} held by a live lease")
    if out_of_time:
        parts.append(f"stopped after {TICK_BUDGET_S:.0f} s; continuing next tick")
    if walk.end.run_id is not None:
        parts.append(
            f"runs left undone: {walk.examined} keys of {walk.runs} runs looked at, resuming at run "
            f"{walk.end.run_id} key {walk.end.offset + 1}"
        )
    parts.append(f"{remaining} lease rows still to look at in this sweep")
    return "; ".join(parts)


# ---- the builder -----------------------------------------------------------------------------------------


def _check_target(target: object, code: str) -> facts.Target:
    if not isinstance(target, dg.AssetsDefinition | dg.JobDefinition):
        raise errors.ConfigurationError(
            f"build_reconciliation_sensor target {target!r} must be a partitioned JobDefinition or a "
            "partitioned AssetsDefinition (e.g. one built with @leased_asset)"
        )
    if target.partitions_def is None:
        label = (
            f"asset {target.key.to_user_string()!r}"
            if isinstance(target, dg.AssetsDefinition)
            else f"job {target.name!r}"
        )
        raise errors.ConfigurationError(
            f"{label} (code {code!r}) has no partitions_def; reconciliation relaunches partitions, so give "
            "it one (an INITIAL job is retried the next time it is launched)"
        )
    return facts.Target(target)


def _durations(**values: object) -> dict[str, int]:
    found = {}
    for label, value in values.items():
        if not isinstance(value, dt.timedelta) or value < dt.timedelta(0):
            raise errors.ConfigurationError(
                f"build_reconciliation_sensor {label}={value!r} must be a non-negative datetime.timedelta"
            )
        found[label] = int(value.total_seconds() * 1000)
    return found


def _check_catch_up(settings_target: facts.Target, catch_up_from: str | None) -> None:
    if catch_up_from is None:
        return
    with dg.partition_loading_context(effective_dt=dt.datetime.now(dt.UTC)):
        if not settings_target.partitions_def.has_partition_key(catch_up_from):
            raise errors.ConfigurationError(
                f"build_reconciliation_sensor catch_up_from={catch_up_from!r} is not a partition key of "
                f"{settings_target.label}; give an existing key"
            )


#: The reconciliation sensor's default interval. With run retries off, a partition whose run worker was
#: SIGKILLed is relaunched at the first tick after its holder is dead, so this interval is part of the
#: recovery time: 10 s keeps a kill's effect at the downstream within a minute with the resource's
#: default 10 s heartbeat (``benchmarks/kill_to_effect.py``; at 60 s it took 82-92 s). A tick at 50,000
#: lease rows takes about 2.5 s: lengthen it for such lookbacks, at that price.
RECONCILE_INTERVAL_S = 10


def build_reconciliation_sensor(
    target: dg.JobDefinition | dg.AssetsDefinition,
    *,
    code: str,
    name: str | None = None,
    lookback: dt.timedelta = dt.timedelta(days=7),
    catch_up_from: str | None = None,
    max_requests_per_tick: int = 10,
    max_relaunches: int = 5,
    backoff: dt.timedelta = dt.timedelta(minutes=2),
    max_backoff: dt.timedelta = dt.timedelta(hours=1),
    relaunch_canceled: bool = False,
    holder_stale_ms: int | None = None,
    zombie_margin: dt.timedelta = dt.timedelta(minutes=5),
    health: OutboxHealth | None = None,
    checks_interval_seconds: int = 300,
    minimum_interval_seconds: int = RECONCILE_INTERVAL_S,
    resource_key: str = "joblease",
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    description: str | None = None,
) -> dg.SensorDefinition:
    """A sensor that relaunches the partitions of ``target`` (lease ``code``) left undone.

    Args:
        target: a partitioned job (its leased op uses ``code``) or a partitioned leased asset.
        lookback: only lease rows active (heartbeat or finish) within this window, and runs created within
            it, are considered.
        catch_up_from: a partition key; partitions from it up to the last complete one that were never
            attempted (no lease row) are requested too, oldest first. ``None`` (default): no catch-up.
        max_requests_per_tick: at most this many run requests per evaluation (relaunches first).
        max_relaunches: attempts per partition by this sensor before it gives up and says so: its
            relaunches and the run retries Dagster launched for them (``dagster/retry_number``); a
            person's re-execution does not count.
        backoff / max_backoff: the n-th relaunch waits ``backoff * 2**(n-2)`` (capped) after the lease's
            last activity; the first relaunch is immediate.
        relaunch_canceled: relaunch a partition whose latest run was canceled (default: leave it alone),
            and the keys a canceled range run never reached.
        holder_stale_ms: a RUNNING lease's holder is dead by the liveness rule
            (:func:`dagster_joblease.staleness.holder_death`, which waiting runs apply too): its lease
            expired, its heartbeat is missing for four of the intervals the *holder* recorded on its row,
            or its Dagster run on this instance is finished and its heartbeat older than two of them. This
            setting may only lengthen those thresholds, never shorten them (a holder recorded with no
            heartbeat is judged by expiry only). Rows from before migration 0002: this value (default
            twice the resource's heartbeat) stands for two intervals. The sensor fails a dead holder's
            lease (fenced) and relaunches the partition, which reclaims it.
        zombie_margin: a STARTED run that holds no lease is still counted in flight for the resource's held
            wait plus this margin after it started or last held a lease (it may be waiting for a holder);
            after that it is a zombie and its undone keys are relaunched.
        health: also report these outbox checks (at most every ``checks_interval_seconds``), so they run
            without a dispatcher run.
        default_status: RUNNING by default: it is the safety net, it only acts on partitions someone
            already launched (unless ``catch_up_from`` is set), and each relaunch is capped.

    Each request is ``RunRequest(partition_key=key)`` with run key
    ``reconcile:<code>:<key>:attempt-<lease attempt>:relaunch-<n>`` and the launch tags
    ``joblease/relaunch`` (``n/max``) and ``joblease/reconcile_reason`` (plus ``joblease/outcome=pending``);
    Dagster adds ``dagster/sensor_name``, by which the cap counts. For an asset, the request selects the
    asset, and the upstream assets of the run that left the key undone which did not finish it either.
    """
    code = identity.JobIdentity.initial(code).code
    checked = _check_target(target, code)
    asset_key = checked.asset_key
    sensor_name = (
        name or f"{checked.job_name if asset_key is None else asset_key.to_python_identifier()}_reconcile"
    )
    durations = _durations(
        lookback=lookback, backoff=backoff, max_backoff=max_backoff, zombie_margin=zombie_margin
    )
    if holder_stale_ms is not None:
        checks.milliseconds("holder_stale_ms", holder_stale_ms, minimum=1)
    _check_catch_up(checked, catch_up_from)
    settings = _Settings(
        target=checked,
        code=code,
        sensor_name=sensor_name,
        lookback=lookback,
        catch_up_from=catch_up_from,
        max_requests=checks.integer("max_requests_per_tick", max_requests_per_tick, minimum=1),
        cap=checks.integer("max_relaunches", max_relaunches, minimum=1),
        backoff_ms=durations["backoff"],
        max_backoff_ms=durations["max_backoff"],
        relaunch_canceled=relaunch_canceled,
        holder_stale_ms=holder_stale_ms,
        margin_ms=durations["zombie_margin"],
        health=health,
        checks_every=checks.integer(
            "checks_interval_seconds", checks_interval_seconds, minimum=1, unit="seconds"
        ),
        resource_key=resource_key,
    )

    def _evaluate(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        return _Tick(context, settings).evaluate()

    decorator_kwargs: dict[str, Any] = (
        # The job by name: a sensor holding the job object is rebuilt when Definitions binds resources,
        # and that copy raises a BetaWarning (``owners=[]``) in every process that loads the location.
        # An asset's sensor targets its upstream assets too: a key a run left undone upstream is relaunched
        # with them (Dagster refuses requests for assets outside the sensor's selection).
        {"job_name": checked.job_name}
        if asset_key is None
        else {"asset_selection": dg.AssetSelection.assets(asset_key).upstream()}
    )
    sensor: dg.SensorDefinition = dg.sensor(
        name=sensor_name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        required_resource_keys={resource_key},
        description=description
        or f"Relaunches partitions of lease code {code!r} left undone (failed, expired, dead holder, zombie "
        "runs, keys a failed, killed or held run left undone"
        + (f", never attempted since {catch_up_from}" if catch_up_from else "")
        + f"); at most {max_relaunches} relaunches per partition.",
        **decorator_kwargs,
    )(_evaluate)
    return sensor
