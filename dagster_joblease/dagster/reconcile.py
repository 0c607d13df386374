"""The reconciliation sensor: nothing stays undone silently.

A partition can be left undone with nothing scheduled to redo it: its holder was SIGKILLed (the lease
expires, but no run is coming back for it), a run failed after Dagster's own retries (off by default) were
spent, a backfill already counted as finished, or a run gave up waiting for a live holder (``held``).
Dagster does not know the partition still needs work; the lease table does. Each tick this sensor reads
the lease rows of one code (database clock) and the Dagster runs of those partitions, and requests a run
for every partition that

- has a ``FAIL`` lease, an expired ``RUNNING`` lease, or a ``RUNNING`` lease whose holder's Dagster run is
  finished and whose heartbeat is stale (a dead holder), with activity inside the lookback window; or
- whose latest run failed with the outcome ``held`` (a run that gave up on a live holder); or
- (with ``catch_up_from``) was never attempted at all, oldest first, after downtime.

Relaunches are capped per partition (``max_relaunches``) with exponential backoff between them, so a
deterministic bug does not loop forever; a capped partition is named in the skip message and the sensor
cursor. A partition whose latest run was canceled (by a person) is left alone unless
``relaunch_canceled=True``. Run keys include the lease attempt and the relaunch number, so they never
collide with an earlier request (a sensor's run keys dedupe forever). A relaunched run is an ordinary
leased run: the lease still lets exactly one run do the work.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Iterator, Sequence
from typing import Any

import dagster as dg
import sqlalchemy as sa

from dagster_joblease import errors, identity, staleness
from dagster_joblease.dagster import holders, metadata
from dagster_joblease.dagster.jobs import OutboxHealth
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.dagster.sensors import NOT_FINISHED_STATUSES, db_clock
from dagster_joblease.storage.clock import ms_until
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.schema import lease_table

__all__ = [
    "TAG_RECONCILE",
    "TAG_RELAUNCH",
    "TAG_RECONCILE_REASON",
    "build_reconciliation_sensor",
]

TAG_RECONCILE = metadata.TAG_SENSOR_NAME  # Dagster's dagster/sensor_name: which sensor launched a run
TAG_RELAUNCH = metadata.TAG_RELAUNCH
TAG_RECONCILE_REASON = metadata.TAG_RECONCILE_REASON
PARTITION_TAG = "dagster/partition"
ASSET_JOB_NAME = "__ASSET_JOB"
HELD_OUTCOME = metadata.HELD
#: At most this many lease rows and runs are read per tick; the rest wait for the next tick.
MAX_ROWS_PER_TICK = 1_000
CATCH_UP_CHUNK = 500
SHOWN_IN_CURSOR = 50


@dataclasses.dataclass(frozen=True)
class _Candidate:
    key: str
    reason: str
    attempt: int  #: the lease's attempt (0: no lease row)
    idle_ms: int | None  #: ms since the lease's last activity, database clock (None: no lease row)


@dataclasses.dataclass
class _Verdicts:
    requests: list[dg.RunRequest] = dataclasses.field(default_factory=list)
    capped: dict[str, str] = dataclasses.field(default_factory=dict)
    waiting: dict[str, str] = dataclasses.field(default_factory=dict)
    canceled: list[str] = dataclasses.field(default_factory=list)
    in_flight: list[str] = dataclasses.field(default_factory=list)
    deferred: list[str] = dataclasses.field(default_factory=list)


def _positive(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise errors.ConfigurationError(
            f"build_reconciliation_sensor {name}={value!r} must be an int >= {minimum}"
        )
    return value


def _target(
    target: dg.JobDefinition | dg.AssetsDefinition, code: str
) -> tuple[dg.PartitionsDefinition, str, dg.AssetKey | None]:
    if isinstance(target, dg.AssetsDefinition):
        partitions_def = target.partitions_def
        asset_key: dg.AssetKey | None = target.key
        job_name = ASSET_JOB_NAME
        label = f"asset {target.key.to_user_string()!r}"
    elif isinstance(target, dg.JobDefinition):
        partitions_def = target.partitions_def
        asset_key = None
        job_name = target.name
        label = f"job {target.name!r}"
    else:
        raise errors.ConfigurationError(
            f"build_reconciliation_sensor target {target!r} must be a partitioned JobDefinition or a "
            "partitioned AssetsDefinition (e.g. one built with @leased_asset)"
        )
    if partitions_def is None:
        raise errors.ConfigurationError(
            f"{label} (code {code!r}) has no partitions_def; reconciliation relaunches partitions, so give "
            "it one (an INITIAL job is retried the next time it is launched)"
        )
    return partitions_def, job_name, asset_key


def _lease_candidates(
    engine: sa.Engine,
    instance: dg.DagsterInstance,
    code: str,
    lookback_ms: int,
    legacy_stale_ms: int,
    holder_stale_ms: int | None,
) -> tuple[list[_Candidate], set[str]]:
    """Lease rows needing a run, and the keys held by a live lease (database clock throughout)."""
    t = lease_table
    idle = -ms_until(sa.func.coalesce(t.c.finished_at, t.c.heartbeat_at))
    stmt = (
        sa.select(
            t.c.run_key,
            t.c.status,
            t.c.attempt,
            t.c.holder,
            -ms_until(t.c.expires_at),
            -ms_until(t.c.heartbeat_at),
            idle,
            t.c.heartbeat_ms,
        )
        .where(
            t.c.code == code,
            t.c.job_type == identity.JobType.SCHEDULE.value,
            t.c.status.in_(["FAIL", "RUNNING"]),
            idle <= lookback_ms,
        )
        .order_by(t.c.run_key)
        .limit(MAX_ROWS_PER_TICK)
    )
    with translate_errors("read leases to reconcile"), engine.connect() as conn:
        rows = conn.execute(stmt).all()
    candidates: list[_Candidate] = []
    live: set[str] = set()
    for run_key, status, attempt, holder, overdue_ms, heartbeat_age_ms, idle_ms, heartbeat_ms in rows:
        if status == "FAIL":
            candidates.append(_Candidate(run_key, "lease FAIL", attempt, int(idle_ms)))
        elif overdue_ms > 0:
            candidates.append(_Candidate(run_key, "lease expired", attempt, int(idle_ms)))
        else:
            # Stale by the holder's own recorded interval; holder_stale_ms may only lengthen that.
            threshold = staleness.stale_after_ms(
                heartbeat_ms, legacy_ms=legacy_stale_ms, at_least_ms=holder_stale_ms
            )
            if (
                staleness.is_stale(heartbeat_age_ms, threshold)
                and holders.holder_run_finished(instance, holder) is True
            ):
                candidates.append(_Candidate(run_key, f"dead holder {holder}", attempt, int(idle_ms)))
            else:
                live.add(run_key)
    return candidates, live


def _catch_up_chunks(
    engine: sa.Engine,
    partitions_def: dg.PartitionsDefinition,
    code: str,
    start: str,
    now: dt.datetime,
    skip: set[str],
) -> Iterator[list[str]]:
    """Partition keys from ``start`` on that have no lease row (never attempted), oldest first, in chunks."""
    with dg.partition_loading_context(effective_dt=now):
        last = partitions_def.get_last_partition_key()
        if last is None or not partitions_def.has_partition_key(start):
            return
        # From ``start`` on only: a time-window definition lists just that window, not its whole history.
        keys = list(partitions_def.get_partition_keys_in_range(dg.PartitionKeyRange(start, last)))
    t = lease_table
    for offset in range(0, len(keys), CATCH_UP_CHUNK):
        chunk = keys[offset : offset + CATCH_UP_CHUNK]
        with translate_errors("read leases to catch up"), engine.connect() as conn:
            attempted = set(
                conn.execute(
                    sa.select(t.c.run_key).where(
                        t.c.code == code,
                        t.c.job_type == identity.JobType.SCHEDULE.value,
                        t.c.run_key.in_(chunk),
                    )
                ).scalars()
            )
        fresh = [k for k in chunk if k not in attempted and k not in skip]
        if fresh:
            yield fresh


def _runs_by_partition(
    instance: dg.DagsterInstance, job_name: str, asset_key: dg.AssetKey | None, keys: Sequence[str]
) -> dict[str, list[dg.DagsterRun]]:
    """Runs of the target per partition key, newest first."""
    by_key: dict[str, list[dg.DagsterRun]] = {k: [] for k in keys}
    if not keys:
        return by_key
    runs = instance.get_runs(
        dg.RunsFilter(job_name=job_name, tags={PARTITION_TAG: list(keys)}), limit=MAX_ROWS_PER_TICK
    )
    for run in runs:
        if asset_key is not None and run.asset_selection is not None and asset_key not in run.asset_selection:
            continue
        key = run.tags.get(PARTITION_TAG)
        if key in by_key:
            by_key[key].append(run)
    return by_key


def _run_end_age_ms(instance: dg.DagsterInstance, run: dg.DagsterRun, now: dt.datetime) -> int | None:
    record = instance.get_run_record_by_id(run.run_id)
    if record is None:
        return None
    ended = record.end_time or record.update_timestamp.timestamp()
    return int((now.timestamp() - ended) * 1000)


def _backoff_ms(relaunches: int, base_ms: int, max_ms: int) -> int:
    return 0 if relaunches == 0 else min(max_ms, base_ms * 2 ** (relaunches - 1))


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
    health: OutboxHealth | None = None,
    checks_interval_seconds: int = 300,
    minimum_interval_seconds: int = 60,
    resource_key: str = "joblease",
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    description: str | None = None,
) -> dg.SensorDefinition:
    """A sensor that relaunches the partitions of ``target`` (lease ``code``) left undone.

    Args:
        target: a partitioned job (its leased op uses ``code``) or a partitioned leased asset.
        lookback: only lease rows active (heartbeat or finish) within this window, and ``held`` runs created
            within it, are considered.
        catch_up_from: a partition key; partitions from it up to the last complete one that were never
            attempted (no lease row) are requested too, oldest first. ``None`` (default): no catch-up.
        max_requests_per_tick: at most this many run requests per evaluation (relaunches first).
        max_relaunches: relaunches per partition by this sensor before it gives up and says so.
        backoff / max_backoff: the n-th relaunch waits ``backoff * 2**(n-2)`` (capped) after the lease's
            last activity; the first relaunch is immediate.
        relaunch_canceled: relaunch a partition whose latest run was canceled (default: leave it alone).
        holder_stale_ms: a RUNNING lease whose holder's Dagster run is finished (on this instance) is
            relaunched once its heartbeat is older than twice the interval the *holder* recorded on its
            row; this setting may only lengthen that threshold, never shorten it (a holder recorded with
            no heartbeat is judged by expiry only). Rows from before migration 0002 keep the old rule:
            this value, default twice the resource's heartbeat. The relaunched run takes the dead
            holder's lease over.
        health: also report these outbox checks (at most every ``checks_interval_seconds``), so they run
            without a dispatcher run.
        default_status: RUNNING by default: it is the safety net, it only acts on partitions someone
            already launched (unless ``catch_up_from`` is set), and each relaunch is capped.

    Each request is ``RunRequest(partition_key=key)`` with run key
    ``reconcile:<code>:<key>:attempt-<lease attempt>:relaunch-<n>`` and tags ``dagster/sensor_name``
    (this sensor), ``joblease/relaunch`` (``n/max``) and ``joblease/reconcile_reason``.
    """
    code = identity.JobIdentity.initial(code).code
    partitions_def, job_name, asset_key = _target(target, code)
    sensor_name = name or f"{job_name if asset_key is None else asset_key.to_python_identifier()}_reconcile"
    max_requests = _positive("max_requests_per_tick", max_requests_per_tick)
    cap = _positive("max_relaunches", max_relaunches)
    checks_every = _positive("checks_interval_seconds", checks_interval_seconds)
    for label, value in (("lookback", lookback), ("backoff", backoff), ("max_backoff", max_backoff)):
        if not isinstance(value, dt.timedelta) or value < dt.timedelta(0):
            raise errors.ConfigurationError(
                f"build_reconciliation_sensor {label}={value!r} must be a non-negative datetime.timedelta"
            )
    if holder_stale_ms is not None:
        _positive("holder_stale_ms", holder_stale_ms)
    if catch_up_from is not None:
        with dg.partition_loading_context(effective_dt=dt.datetime.now(dt.UTC)):
            if not partitions_def.has_partition_key(catch_up_from):
                raise errors.ConfigurationError(
                    f"build_reconciliation_sensor catch_up_from={catch_up_from!r} is not a partition key of "
                    f"{job_name if asset_key is None else asset_key.to_user_string()}; give an existing key"
                )
    lookback_ms = int(lookback.total_seconds() * 1000)
    base_ms = int(backoff.total_seconds() * 1000)
    max_ms = int(max_backoff.total_seconds() * 1000)

    def _evaluate(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        resource: JobLeaseResource = getattr(context.resources, resource_key)
        engine = resource.engine
        instance = context.instance
        now = db_clock(engine)
        cursor: dict[str, Any] = json.loads(context.cursor) if context.cursor else {}

        timing = resource.timing()
        legacy_ms = holder_stale_ms or 2 * (timing.heartbeat_ms or timing.lease_ms)
        candidates, live = _lease_candidates(engine, instance, code, lookback_ms, legacy_ms, holder_stale_ms)
        by_key = {c.key: c for c in candidates}
        held_runs = instance.get_runs(
            dg.RunsFilter(
                job_name=job_name,
                statuses=[dg.DagsterRunStatus.FAILURE],
                tags={metadata.TAG_OUTCOME: HELD_OUTCOME},
                created_after=now - lookback,
            ),
            limit=MAX_ROWS_PER_TICK,
        )
        held_keys = {r.tags[PARTITION_TAG] for r in held_runs if PARTITION_TAG in r.tags}
        for key in sorted(held_keys - live - set(by_key)):
            by_key[key] = _Candidate(key, "last run failed: held", 0, None)
        with dg.partition_loading_context(effective_dt=now):
            valid = {k for k in by_key if partitions_def.has_partition_key(k)}
        ordered = sorted(valid)
        runs = _runs_by_partition(instance, job_name, asset_key, ordered)

        verdicts = _Verdicts()

        def judge(candidate: _Candidate, key_runs: list[dg.DagsterRun]) -> None:
            key = candidate.key
            if len(verdicts.requests) >= max_requests:
                verdicts.deferred.append(key)
                return
            unfinished = [r for r in key_runs if r.status in NOT_FINISHED_STATUSES]
            if unfinished:
                verdicts.in_flight.append(key)
                return
            latest = key_runs[0] if key_runs else None
            if candidate.reason.startswith("last run failed") and (
                latest is None
                or latest.status != dg.DagsterRunStatus.FAILURE
                or latest.tags.get(metadata.TAG_OUTCOME) != HELD_OUTCOME
            ):
                return  # a later run already settled it
            if latest is not None and latest.status == dg.DagsterRunStatus.CANCELED and not relaunch_canceled:
                verdicts.canceled.append(key)
                return
            # Only the sensor's own launches count: a re-execution or run retry inherits their tags.
            ours = [
                r for r in key_runs if r.tags.get(TAG_RECONCILE) == sensor_name and r.parent_run_id is None
            ]
            relaunches = len(ours)
            if relaunches >= cap:
                verdicts.capped[key] = (
                    f"{relaunches} relaunches ({candidate.reason}); last run {ours[0].run_id}"
                )
                return
            idle = candidate.idle_ms
            if idle is None and ours:
                idle = _run_end_age_ms(instance, ours[0], now)
            wait = _backoff_ms(relaunches, base_ms, max_ms)
            if idle is not None and idle < wait:
                verdicts.waiting[key] = f"relaunch {relaunches + 1} in {(wait - idle) / 1000:.0f} s"
                return
            verdicts.requests.append(
                dg.RunRequest(
                    run_key=(f"reconcile:{code}:{key}:attempt-{candidate.attempt}:relaunch-{relaunches + 1}"),
                    partition_key=key,
                    asset_selection=[asset_key] if asset_key is not None else None,
                    tags={
                        **metadata.schedule_tags(code, key),
                        TAG_RECONCILE: sensor_name,
                        TAG_RELAUNCH: f"{relaunches + 1}/{cap}",
                        TAG_RECONCILE_REASON: candidate.reason[:200],
                    },
                )
            )

        for key in ordered:
            judge(by_key[key], runs[key])

        if catch_up_from is not None:
            for chunk in _catch_up_chunks(engine, partitions_def, code, catch_up_from, now, set(by_key)):
                if len(verdicts.requests) >= max_requests:
                    break
                chunk_runs = _runs_by_partition(instance, job_name, asset_key, chunk)
                for key in chunk:
                    if len(verdicts.requests) >= max_requests:
                        break
                    judge(_Candidate(key, "never attempted (catch-up)", 0, None), chunk_runs[key])

        asset_events: list[dg.AssetCheckEvaluation] = []
        checks_at = float(cursor.get("checks_at", 0))
        if health is not None and now.timestamp() - checks_at >= checks_every:
            asset_events = health.evaluate(engine)
            checks_at = now.timestamp()
        new_cursor = {
            "checks_at": checks_at,
            "capped": dict(sorted(verdicts.capped.items())[:SHOWN_IN_CURSOR]),
            "capped_count": len(verdicts.capped),
        }
        for request in verdicts.requests:
            context.log.info(
                f"relaunching {request.partition_key} ({request.tags[TAG_RECONCILE_REASON]}), "
                f"relaunch {request.tags[TAG_RELAUNCH]}"
            )
        for key, why in verdicts.capped.items():
            context.log.warning(
                f"partition {key} of code {code!r} is still undone after {why}; relaunch cap {cap} reached: "
                "fix the cause, then launch it by hand (or `joblease leases fail` and raise the cap)"
            )
        parts = [f"{len(verdicts.requests)} relaunched"]
        if verdicts.capped:
            parts.append(
                f"CAPPED after {cap} relaunches: "
                + ", ".join(f"{k} ({v})" for k, v in sorted(verdicts.capped.items())[:10])
            )
        if verdicts.waiting:
            parts.append(
                "backing off: " + ", ".join(f"{k} ({v})" for k, v in sorted(verdicts.waiting.items())[:10])
            )
        if verdicts.canceled:
            parts.append(
                "latest run canceled, not relaunched (relaunch_canceled=False): "
                + ", ".join(verdicts.canceled[:10])
            )
        if verdicts.in_flight:
            parts.append(f"a run is already queued or running: {', '.join(verdicts.in_flight[:10])}")
        if verdicts.deferred:
            parts.append(f"{len(verdicts.deferred)} more next tick (max_requests_per_tick={max_requests})")
        if live:
            parts.append(f"{len(live)} held by a live lease")
        message = "; ".join(parts)
        return dg.SensorResult(
            run_requests=verdicts.requests,
            skip_reason=None if verdicts.requests else dg.SkipReason(message),
            asset_events=asset_events,
            cursor=json.dumps(new_cursor, sort_keys=True),
        )

    decorator_kwargs: dict[str, Any] = (
        # The job by name: a sensor holding the job object is rebuilt when Definitions binds resources,
        # and that copy raises a BetaWarning (``owners=[]``) in every process that loads the location.
        {"job_name": job_name} if asset_key is None else {"asset_selection": [asset_key]}
    )
    sensor: dg.SensorDefinition = dg.sensor(
        name=sensor_name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        required_resource_keys={resource_key},
        description=description
        or f"Relaunches partitions of lease code {code!r} left undone (failed, expired, dead holder, held"
        + (f", never attempted since {catch_up_from}" if catch_up_from else "")
        + f"); at most {cap} relaunches per partition.",
        **decorator_kwargs,
    )(_evaluate)
    return sensor
