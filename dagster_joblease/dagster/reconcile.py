"""The reconciliation sensor: nothing stays undone silently, at any number of partitions and runs.

A partition can be left undone with nothing scheduled to redo it: its holder was SIGKILLed (the lease
expires, but no run is coming back for it), a run failed after Dagster's own retries (off by default) were
spent, a backfill already counted as finished, a run gave up waiting for a live holder (``held``), or a
range run stopped before trying some of its keys (``not-attempted``). Dagster does not know the partition
still needs work; the lease table does. Each tick this sensor requests a run for every partition that

- has a ``FAIL`` lease, an expired ``RUNNING`` lease, or a ``RUNNING`` lease whose holder's Dagster run is
  finished and whose heartbeat is stale *by the holder's own recorded interval* (a dead holder), with
  activity inside the lookback window; or
- whose latest run failed with the outcome ``held`` (a run that gave up on a live holder); or
- belongs to a failed range run that never claimed it (no lease row: ``not-attempted``); or
- (with ``catch_up_from``) was never attempted at all, oldest first, after downtime.

**Paging.** Each tick reads the most recently active lease rows first (a new failure is seen within one
tick), then continues a sweep through older rows by row id from where the last tick stopped (the sensor
cursor), wrapping around at the end; every row in the lookback window is looked at within
``ceil(rows / SWEEP_ROWS_PER_TICK)`` ticks (plus one per ``max_requests_per_tick`` requests it defers).
The skip message says how many rows are still to look at in the current sweep. Runs that failed as
``held`` are paged the same way: the newest :data:`HELD_RUNS_PER_PAGE` every tick, then one older page from
the cursor (``held_before``), wrapping around. A tick also stops
judging after :data:`TICK_BUDGET_S` seconds (Dagster's sensor timeout is 60 s) and resumes there.

**Runs of a partition, whatever launched them.** Caps, backoff, a person's cancel and the in-flight check
look at every run of the partition: single-partition runs (``dagster/partition``), range runs (Dagster
tags them ``dagster/asset_partition_range_start``/``_end``; tag filters are equality-only, so range runs
are fetched by their range-start values and time and matched in memory, bounded) and, for an asset, runs
of every job that targets it (``define_asset_job`` jobs and the implicit ``__ASSET_JOB``). Queries go by
pages of keys with per-key fallbacks when a page's answer was cut off, so no window of "the newest 1,000
runs" can hide a partition's runs.

**Zombie runs.** A run still ``STARTING``/``STARTED`` counts as in flight only while it holds the
partition's lease live, or while it could still be waiting for a holder (created within the held wait
plus ``zombie_margin``). One whose own lease expired (by the holder's own lease length), or that holds
nothing long after it could have been waiting, is a zombie: typically its worker was SIGKILLed and, with
Dagster's run monitoring off (the default), Dagster still calls it STARTED. The partition is relaunched
and the zombie run is tagged ``joblease/outcome=lost``. A stale heartbeat on an unexpired lease is not
proof of death: the sensor waits for expiry. Enable run monitoring to have Dagster fail such runs and free
their queue slots.

**Done but not recorded.** For a leased asset, a partition whose lease is ``SUCCESS`` but which has no
materialization on this instance (a run killed between completing the lease and logging its event) is
recorded by the sensor (an ``AssetMaterialization`` pointing at the run that did it) instead of relaunched.

Relaunches are capped per partition (``max_relaunches``) with exponential backoff between them, so a
deterministic bug does not loop forever; a capped partition is named in the skip message and the sensor
cursor. The cap counts the partition's runs that Dagster tagged with this sensor's name
(``dagster/sensor_name``) and that are not re-executions or retries (``parent_run_id is None``). A
partition whose latest run was canceled (by a person) is left alone unless ``relaunch_canceled=True``.
Run keys include the lease attempt and the relaunch number, so they never collide with an earlier
request (a sensor's run keys dedupe forever). A relaunched run is an ordinary leased run: the lease still
lets exactly one run do the work.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import dagster as dg
import sqlalchemy as sa
from dagster._core.events import DagsterEventType

from dagster_joblease import errors, identity, staleness
from dagster_joblease.dagster import holders, metadata
from dagster_joblease.dagster.jobs import OutboxHealth
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.dagster.sensors import NOT_FINISHED_STATUSES, db_clock
from dagster_joblease.storage.clock import ms_until
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.schema import any_status, lease_table

__all__ = [
    "TAG_RECONCILE",
    "TAG_RECONCILE_REASON",
    "TAG_RELAUNCH",
    "build_reconciliation_sensor",
    "is_zombie",
]

#: Which sensor launched a run: Dagster's own ``dagster/sensor_name`` (the relaunch cap counts by it).
TAG_RECONCILE = metadata.TAG_SENSOR_NAME
TAG_RELAUNCH = metadata.TAG_RELAUNCH
TAG_RECONCILE_REASON = metadata.TAG_RECONCILE_REASON
PARTITION_TAG = "dagster/partition"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
ASSET_JOB_NAME = "__ASSET_JOB"
HELD_OUTCOME = metadata.HELD

#: The most recently active lease rows read first, every tick.
RECENT_ROWS_PER_TICK = 200
#: Older rows read per tick by the sweep, continuing from the cursor.
SWEEP_ROWS_PER_TICK = 1_000
#: Candidate keys whose runs are fetched in one query.
KEYS_PER_RUN_QUERY = 100
#: Runs fetched per key of a page; a page's answer that fills its limit is re-read key by key.
RUNS_PER_KEY = 10
#: Range runs inside the lookback looked at per tick, newest first.
RANGE_RUNS_PER_TICK = 500
#: Runs that failed as ``held`` read per page: the newest page every tick, then one older page from the
#: cursor (``held_before``), wrapping around, so every held run in the lookback is looked at in turn.
HELD_RUNS_PER_PAGE = 500
#: Keys of failed range runs checked for "never claimed" per tick.
RANGE_KEYS_PER_TICK = 2_000
#: A tick stops judging after this long and resumes there next tick (Dagster's sensor timeout: 60 s).
TICK_BUDGET_S = 20.0
#: A SUCCESS lease whose holder's run is still STARTED this long after finishing has no event coming.
MATERIALIZATION_GRACE_MS = 10 * 60_000
CATCH_UP_CHUNK = 500
SHOWN_IN_CURSOR = 50
SHOWN_IN_MESSAGE = 10

_WAITING_STATUSES = frozenset(
    {dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.CANCELING}
)
_RUNNING_STATUSES = frozenset({dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED})


@dataclasses.dataclass(frozen=True)
class _LeaseRow:
    """A lease row as reconciliation sees it; ages are on the database clock."""

    id: int
    key: str
    status: str
    attempt: int
    holder: str | None
    overdue_ms: int  #: > 0: the lease expired that long ago (by the holder's own length)
    heartbeat_age_ms: int
    idle_ms: int  #: since the last heartbeat or finish
    heartbeat_ms: int | None  #: the holder's recorded interval (None: a row from before 0002)

    @property
    def holder_run_id(self) -> str | None:
        decoded = holders.decode_holder(self.holder)
        return None if decoded is None else decoded.run_id

    @property
    def live(self) -> bool:
        return self.status == "RUNNING" and self.overdue_ms <= 0


@dataclasses.dataclass(frozen=True)
class _Candidate:
    key: str
    reason: str
    attempt: int  #: the lease's attempt (0: no lease row)
    idle_ms: int | None  #: ms since the lease's last activity, database clock (None: no lease row)
    row: _LeaseRow | None = None


@dataclasses.dataclass
class _Verdicts:
    requests: list[dg.RunRequest] = dataclasses.field(default_factory=list)
    capped: dict[str, str] = dataclasses.field(default_factory=dict)
    waiting: dict[str, str] = dataclasses.field(default_factory=dict)
    canceled: list[str] = dataclasses.field(default_factory=list)
    in_flight: list[str] = dataclasses.field(default_factory=list)
    zombies: dict[str, tuple[dg.DagsterRun, str]] = dataclasses.field(default_factory=dict)
    deferred: list[str] = dataclasses.field(default_factory=list)
    recorded: list[str] = dataclasses.field(default_factory=list)
    live: int = 0


@dataclasses.dataclass(frozen=True)
class _RangeRun:
    run: dg.DagsterRun
    keys: tuple[str, ...]  #: the range's keys, in order (from the partitions definition)
    members: frozenset[str]

    def __contains__(self, key: str) -> bool:
        return key in self.members


# ---- pure decisions ------------------------------------------------------------------------------------


def is_zombie(
    status: dg.DagsterRunStatus,
    *,
    holds_live_lease: bool,
    lease_expired_on_it: bool,
    age_ms: int,
    may_wait_ms: int,
) -> bool:
    """Is an unfinished run of a partition a zombie (not in flight)?

    Queued, not-started and canceling runs are in flight. A STARTING/STARTED run is in flight while it
    holds the partition's lease live (RUNNING and unexpired: a stale heartbeat alone is not proof of
    death). A run whose own lease expired (``lease_expired_on_it``: it is the recorded holder of a RUNNING
    row past its expiry, by its own lease length) is a zombie at once: it stopped renewing. Any other
    run is in flight while it is young enough to still be waiting for a holder (``age_ms <=
    may_wait_ms``, the held wait plus a margin), a zombie after that.
    """
    if status not in _RUNNING_STATUSES or holds_live_lease:
        return False
    return lease_expired_on_it or age_ms > may_wait_ms


def _backoff_ms(relaunches: int, base_ms: int, max_ms: int) -> int:
    return 0 if relaunches == 0 else min(max_ms, base_ms * 2 ** (relaunches - 1))


def _lease_verdict(
    row: _LeaseRow, *, legacy_stale_ms: int, holder_stale_ms: int | None, holder_finished: bool | None
) -> str | None:
    """Why a FAIL/RUNNING row needs a run (None: a live holder has it)."""
    if row.status == "FAIL":
        return "lease FAIL"
    if row.overdue_ms > 0:
        return "lease expired"
    threshold = staleness.stale_after_ms(
        row.heartbeat_ms, legacy_ms=legacy_stale_ms, at_least_ms=holder_stale_ms
    )
    if staleness.is_stale(row.heartbeat_age_ms, threshold) and holder_finished is True:
        return f"dead holder {row.holder}"
    return None


# ---- reads ---------------------------------------------------------------------------------------------


def _activity() -> Any:
    t = lease_table
    return sa.func.coalesce(t.c.finished_at, t.c.heartbeat_at)


def _row_filter(code: str, lookback_ms: int, statuses: Sequence[str]) -> list[Any]:
    t = lease_table
    return [
        t.c.code == code,
        t.c.job_type == identity.JobType.SCHEDULE.value,
        t.c.status.in_(statuses),
        -ms_until(_activity()) <= lookback_ms,
    ]


def _row_columns() -> list[Any]:
    t = lease_table
    return [
        t.c.id,
        t.c.run_key,
        t.c.status,
        t.c.attempt,
        t.c.holder,
        -ms_until(t.c.expires_at),
        -ms_until(t.c.heartbeat_at),
        -ms_until(_activity()),
        t.c.heartbeat_ms,
    ]


def _to_rows(raw: Iterable[Any]) -> list[_LeaseRow]:
    return [
        _LeaseRow(
            id=int(r[0]),
            key=r[1],
            status=r[2],
            attempt=int(r[3]),
            holder=r[4],
            overdue_ms=int(r[5]),
            heartbeat_age_ms=int(r[6]),
            idle_ms=int(r[7]),
            heartbeat_ms=None if r[8] is None else int(r[8]),
        )
        for r in raw
    ]


def _read_pages(
    engine: sa.Engine, code: str, lookback_ms: int, statuses: Sequence[str], sweep_after: int
) -> tuple[list[_LeaseRow], list[_LeaseRow], int]:
    """The most recently active rows, the next sweep page after ``sweep_after``, and the rows after it."""
    t = lease_table
    where = _row_filter(code, lookback_ms, statuses)
    recent = sa.select(*_row_columns()).where(*where).order_by(_activity().desc()).limit(RECENT_ROWS_PER_TICK)
    sweep = (
        sa.select(*_row_columns())
        .where(*where, t.c.id > sweep_after)
        .order_by(t.c.id)
        .limit(SWEEP_ROWS_PER_TICK)
    )
    with translate_errors("read leases to reconcile"), engine.connect() as conn:
        recent_rows = _to_rows(conn.execute(recent))
        sweep_rows = _to_rows(conn.execute(sweep))
        last = sweep_rows[-1].id if sweep_rows else sweep_after
        after = int(
            conn.execute(sa.select(sa.func.count()).select_from(t).where(*where, t.c.id > last)).scalar_one()
        )
    return recent_rows, sweep_rows, after


def _existing_keys(engine: sa.Engine, code: str, keys: Sequence[str]) -> set[str]:
    t = lease_table
    found: set[str] = set()
    with translate_errors("read leases to reconcile"), engine.connect() as conn:
        for offset in range(0, len(keys), CATCH_UP_CHUNK):
            chunk = keys[offset : offset + CATCH_UP_CHUNK]
            found.update(
                conn.execute(
                    sa.select(t.c.run_key).where(
                        t.c.code == code,
                        t.c.job_type == identity.JobType.SCHEDULE.value,
                        t.c.run_key.in_(chunk),
                        any_status(),  # read through the live and succeeded indexes
                    )
                ).scalars()
            )
    return found


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
    for offset in range(0, len(keys), CATCH_UP_CHUNK):
        chunk = keys[offset : offset + CATCH_UP_CHUNK]
        attempted = _existing_keys(engine, code, chunk)
        fresh = [k for k in chunk if k not in attempted and k not in skip]
        if fresh:
            yield fresh


class _Runs:
    """The Dagster runs of the target, looked up per partition key (single and range runs)."""

    def __init__(
        self,
        instance: dg.DagsterInstance,
        job_name: str | None,
        targets: Callable[[dg.DagsterRun], bool],
        sensor_name: str,
        ranges: Sequence[_RangeRun],
    ) -> None:
        self.instance = instance
        self.job_name = job_name
        self.targets = targets
        self.sensor_name = sensor_name
        self.ranges = ranges
        self._created: dict[str, float] = {}

    def created(self, run: dg.DagsterRun) -> float:
        """A run's creation time (seconds since the epoch), from its record, read once per tick."""
        known = self._created.get(run.run_id)
        if known is None:
            record = self.instance.get_run_record_by_id(run.run_id)
            known = record.create_timestamp.timestamp() if record is not None else 0.0
            self._created[run.run_id] = known
        return known

    def _get(self, tags: Mapping[str, str | Sequence[str]], limit: int, **kw: Any) -> list[dg.DagsterRun]:
        runs = self.instance.get_runs(
            dg.RunsFilter(job_name=self.job_name, tags=dict(tags), **kw), limit=limit
        )
        return [r for r in runs if self.targets(r)]

    def _by_key(
        self, keys: Sequence[str], tags: Mapping[str, str], limit_per_key: int
    ) -> dict[str, list[dg.DagsterRun]]:
        """Runs with ``tags`` per key (newest first); a page cut off by its limit is re-read key by key."""
        by_key: dict[str, list[dg.DagsterRun]] = {k: [] for k in keys}
        limit = len(keys) * limit_per_key
        raw = self.instance.get_runs(
            dg.RunsFilter(job_name=self.job_name, tags={PARTITION_TAG: list(keys), **tags}), limit=limit
        )
        if len(raw) >= limit:
            for key in keys:
                by_key[key] = self._get({PARTITION_TAG: key, **tags}, limit_per_key)
            return by_key
        for run in raw:
            tagged = run.tags.get(PARTITION_TAG)
            if tagged is not None and tagged in by_key and self.targets(run):
                by_key[tagged].append(run)
        return by_key

    def for_keys(
        self, keys: Sequence[str], cap: int
    ) -> tuple[dict[str, list[dg.DagsterRun]], dict[str, list[dg.DagsterRun]]]:
        """Per key: its runs newest first (single and range), and this sensor's own launches (root runs)."""
        runs = self._by_key(keys, {}, RUNS_PER_KEY)
        unfinished = self.instance.get_runs(
            dg.RunsFilter(
                job_name=self.job_name, tags={PARTITION_TAG: list(keys)}, statuses=list(NOT_FINISHED_STATUSES)
            ),
            limit=len(keys) * RUNS_PER_KEY,
        )
        seen = {r.run_id for rs in runs.values() for r in rs}
        for run in unfinished:  # an old STARTED run that newer runs pushed out of the page still counts
            key = run.tags.get(PARTITION_TAG)
            if key in runs and run.run_id not in seen and self.targets(run):
                runs[key].append(run)
        if self.ranges:
            for key in keys:
                covering = [rr.run for rr in self.ranges if key in rr]
                if covering:
                    runs[key] = sorted([*runs[key], *covering], key=self.created, reverse=True)
        ours = self._by_key(keys, {metadata.TAG_SENSOR_NAME: self.sensor_name}, cap + RUNS_PER_KEY)
        launched = {k: [r for r in rs if r.parent_run_id is None] for k, rs in ours.items()}
        return runs, launched


def _run_end_age_ms(instance: dg.DagsterInstance, run: dg.DagsterRun, now: dt.datetime) -> int | None:
    record = instance.get_run_record_by_id(run.run_id)
    if record is None:
        return None
    ended = record.end_time or record.update_timestamp.timestamp()
    return int((now.timestamp() - ended) * 1000)


# ---- the sensor ----------------------------------------------------------------------------------------


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


def _asset_jobs(context: dg.SensorEvaluationContext, asset_key: dg.AssetKey) -> set[str]:
    """Names of the jobs in this code location that materialize ``asset_key`` (and ``__ASSET_JOB``)."""
    names = {ASSET_JOB_NAME}
    repository = context.repository_def
    if repository is None:
        return names
    for job in repository.get_all_jobs():
        try:
            if asset_key in job.asset_layer.selected_asset_keys:
                names.add(job.name)
        except Exception:  # a job without an asset layer
            continue
    return names


def _range_runs(
    instance: dg.DagsterInstance,
    job_name: str | None,
    targets: Callable[[dg.DagsterRun], bool],
    since: dt.datetime,
    partitions_def: dg.PartitionsDefinition,
) -> tuple[list[_RangeRun], bool]:
    """Range runs of the target created since ``since`` (newest first, bounded) and whether it was cut.

    Call inside ``partition_loading_context``. Each range's keys come from the partitions definition
    (``get_partition_keys_in_range``: just that range, never the definition's whole history).
    """
    starts: set[str] = set()
    for _key, values in instance.get_run_tags(tag_keys=[RANGE_START_TAG]):
        starts |= values
    if not starts:
        return [], False
    runs = instance.get_runs(
        dg.RunsFilter(job_name=job_name, tags={RANGE_START_TAG: sorted(starts)}, created_after=since),
        limit=RANGE_RUNS_PER_TICK,
    )
    found: list[_RangeRun] = []
    budget = RANGE_KEYS_PER_TICK * 5
    for run in runs:
        if not targets(run):
            continue
        start, end = run.tags.get(RANGE_START_TAG), run.tags.get(RANGE_END_TAG)
        if start is None or end is None:
            continue
        try:
            keys = tuple(partitions_def.get_partition_keys_in_range(dg.PartitionKeyRange(start, end)))
        except Exception:  # a range of keys this definition does not have: not this target's
            continue
        budget -= len(keys)
        if budget < 0:
            return found, True
        found.append(_RangeRun(run, keys, frozenset(keys)))
    return found, len(runs) >= RANGE_RUNS_PER_TICK


def _held_runs(
    instance: dg.DagsterInstance, job_name: str | None, since: dt.datetime, before: float | None
) -> tuple[list[dg.DagsterRun], float | None]:
    """Runs of ``job_name`` that failed as ``held`` since ``since``: the newest page, then the page older
    than the cursor ``before`` (a creation timestamp; from the newest page's oldest run when unset or
    newer). Returns the runs and the next cursor (None: the older pages are done, start over)."""
    filters: dict[str, Any] = {
        "job_name": job_name,
        "statuses": [dg.DagsterRunStatus.FAILURE],
        "tags": {metadata.TAG_OUTCOME: HELD_OUTCOME},
        "created_after": since,
    }
    newest = instance.get_run_records(dg.RunsFilter(**filters), limit=HELD_RUNS_PER_PAGE)
    runs = [record.dagster_run for record in newest]
    if len(newest) < HELD_RUNS_PER_PAGE:
        return runs, None
    boundary = min(record.create_timestamp for record in newest)  # Dagster's are aware, in UTC
    if before is not None and before < boundary.timestamp():
        boundary = dt.datetime.fromtimestamp(before, dt.UTC)
    older = instance.get_run_records(
        dg.RunsFilter(**filters, created_before=boundary), limit=HELD_RUNS_PER_PAGE
    )
    runs += [record.dagster_run for record in older]
    if len(older) < HELD_RUNS_PER_PAGE:
        return runs, None
    return runs, min(record.create_timestamp for record in older).timestamp()


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
    minimum_interval_seconds: int = 60,
    resource_key: str = "joblease",
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    description: str | None = None,
) -> dg.SensorDefinition:
    """A sensor that relaunches the partitions of ``target`` (lease ``code``) left undone.

    Args:
        target: a partitioned job (its leased op uses ``code``) or a partitioned leased asset.
        lookback: only lease rows active (heartbeat or finish) within this window, and ``held`` and range
            runs created within it, are considered.
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
        zombie_margin: a STARTED run that holds no live lease of the partition is still counted in flight
            for the resource's held wait plus this margin after it was created (it may be waiting for a
            holder); after that it is a zombie and the partition is relaunched.
        health: also report these outbox checks (at most every ``checks_interval_seconds``), so they run
            without a dispatcher run.
        default_status: RUNNING by default: it is the safety net, it only acts on partitions someone
            already launched (unless ``catch_up_from`` is set), and each relaunch is capped.

    Each request is ``RunRequest(partition_key=key)`` with run key
    ``reconcile:<code>:<key>:attempt-<lease attempt>:relaunch-<n>`` and the launch tags
    ``joblease/relaunch`` (``n/max``) and ``joblease/reconcile_reason`` (plus ``joblease/outcome=pending``);
    Dagster adds ``dagster/sensor_name``, by which the cap counts.
    """
    code = identity.JobIdentity.initial(code).code
    partitions_def, job_name, asset_key = _target(target, code)
    sensor_name = name or f"{job_name if asset_key is None else asset_key.to_python_identifier()}_reconcile"
    max_requests = _positive("max_requests_per_tick", max_requests_per_tick)
    cap = _positive("max_relaunches", max_relaunches)
    checks_every = _positive("checks_interval_seconds", checks_interval_seconds)
    for label, value in (
        ("lookback", lookback),
        ("backoff", backoff),
        ("max_backoff", max_backoff),
        ("zombie_margin", zombie_margin),
    ):
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
    margin_ms = int(zombie_margin.total_seconds() * 1000)
    statuses = ["FAIL", "RUNNING"] if asset_key is None else ["FAIL", "RUNNING", "SUCCESS"]

    def _evaluate(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        started = time.monotonic()
        resource: JobLeaseResource = getattr(context.resources, resource_key)
        engine = resource.engine
        instance = context.instance
        now = db_clock(engine)
        cursor: dict[str, Any] = json.loads(context.cursor) if context.cursor else {}
        timing = resource.timing()
        legacy_ms = holder_stale_ms or 2 * (timing.heartbeat_ms or timing.lease_ms)
        may_wait_ms = resource.resolved_held_wait_ms() + margin_ms

        if asset_key is None:
            query_job: str | None = job_name

            def targets(run: dg.DagsterRun) -> bool:
                return run.job_name == job_name

        else:
            query_job = None
            asset_jobs = _asset_jobs(context, asset_key)

            def targets(run: dg.DagsterRun) -> bool:
                if run.asset_selection is not None:
                    return asset_key in run.asset_selection
                return run.job_name in asset_jobs

        with dg.partition_loading_context(effective_dt=now):

            def valid(key: str) -> bool:
                return partitions_def.has_partition_key(key)

            ranges, ranges_cut = _range_runs(instance, query_job, targets, now - lookback, partitions_def)

        # -- candidates: recent activity first, then the sweep ------------------------------------------
        sweep_after = int(cursor.get("sweep_after", 0))
        recent_rows, sweep_rows, after_sweep = _read_pages(engine, code, lookback_ms, statuses, sweep_after)
        rows: dict[str, _LeaseRow] = {}
        order: list[str] = []
        sweep_keys: list[tuple[str, int]] = []
        for row in recent_rows:
            if row.key not in rows:
                rows[row.key] = row
                order.append(row.key)
        for row in sweep_rows:
            sweep_keys.append((row.key, row.id))
            if row.key not in rows:
                rows[row.key] = row
                order.append(row.key)
        holder_ids = sorted({r.holder_run_id for r in rows.values() if r.holder_run_id})
        holder_runs: dict[str, dg.DagsterRun] = {}
        for offset in range(0, len(holder_ids), KEYS_PER_RUN_QUERY):
            for run in instance.get_runs(
                dg.RunsFilter(run_ids=holder_ids[offset : offset + KEYS_PER_RUN_QUERY])
            ):
                holder_runs[run.run_id] = run

        def holder_finished(row: _LeaseRow) -> bool | None:
            run = holder_runs.get(row.holder_run_id or "")
            return None if run is None else run.status in holders.FINISHED_RUN_STATUSES

        verdicts = _Verdicts()
        candidates: dict[str, _Candidate] = {}
        unrecorded: list[_LeaseRow] = []
        for key in order:
            row = rows[key]
            if row.status == "SUCCESS":
                unrecorded.append(row)
                continue
            reason = _lease_verdict(
                row,
                legacy_stale_ms=legacy_ms,
                holder_stale_ms=holder_stale_ms,
                holder_finished=holder_finished(row),
            )
            if reason is None:
                verdicts.live += 1
            else:
                candidates[key] = _Candidate(key, reason, row.attempt, row.idle_ms, row)

        held_before = cursor.get("held_before")
        held_runs, next_held_before = _held_runs(
            instance,
            query_job,
            now - lookback,
            float(held_before) if isinstance(held_before, int | float) else None,
        )
        live_keys = {k for k, r in rows.items() if r.live}
        for run in held_runs:
            held_key = run.tags.get(PARTITION_TAG)
            if held_key and targets(run) and held_key not in candidates and held_key not in live_keys:
                candidates[held_key] = _Candidate(
                    held_key, "last run failed: held", 0, None, rows.get(held_key)
                )
        # Keys a failed range run never claimed (no lease row): not-attempted, relaunched one by one.
        range_keys: list[tuple[str, str]] = []
        if ranges:
            for rr in ranges:
                if rr.run.status != dg.DagsterRunStatus.FAILURE:
                    continue
                for key in rr.keys:
                    if len(range_keys) >= RANGE_KEYS_PER_TICK:
                        break
                    if key not in candidates and key not in rows:
                        range_keys.append((key, rr.run.run_id))
            claimed = _existing_keys(engine, code, [k for k, _ in range_keys])
            for key, run_id in range_keys:
                if key not in claimed and key not in candidates:
                    candidates[key] = _Candidate(key, f"not attempted by range run {run_id}", 0, None)

        runs = _Runs(instance, query_job, targets, sensor_name, ranges)

        def judge(candidate: _Candidate, key_runs: list[dg.DagsterRun], ours: list[dg.DagsterRun]) -> None:
            key = candidate.key
            if len(verdicts.requests) >= max_requests:
                verdicts.deferred.append(key)
                return
            row = candidate.row
            flying = False
            for run in key_runs:
                if run.status not in NOT_FINISHED_STATUSES:
                    continue
                own = row is not None and row.holder_run_id == run.run_id
                holds = own and row is not None and row.live
                expired_on_it = own and row is not None and row.status == "RUNNING" and row.overdue_ms > 0
                age_ms = int((now.timestamp() - runs.created(run)) * 1000)
                if is_zombie(
                    run.status,
                    holds_live_lease=holds,
                    lease_expired_on_it=expired_on_it,
                    age_ms=age_ms,
                    may_wait_ms=may_wait_ms,
                ):
                    why = (
                        f"its lease of {key} expired {row.overdue_ms // 1000} s ago (attempt {row.attempt})"
                        if expired_on_it and row is not None
                        else f"it holds no lease of {key} {age_ms // 1000} s after it was created"
                    )
                    verdicts.zombies.setdefault(run.run_id, (run, why))
                else:
                    flying = True
            if flying:
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
                    run_key=f"reconcile:{code}:{key}:attempt-{candidate.attempt}:relaunch-{relaunches + 1}",
                    partition_key=key,
                    asset_selection=[asset_key] if asset_key is not None else None,
                    tags={
                        metadata.TAG_OUTCOME: metadata.PENDING,
                        TAG_RELAUNCH: f"{relaunches + 1}/{cap}",
                        TAG_RECONCILE_REASON: metadata.bound_tag_text(candidate.reason),
                    },
                )
            )

        judged: set[str] = set()
        out_of_time = False
        with dg.partition_loading_context(effective_dt=now):
            ordered = [k for k in candidates if valid(k)]
        for offset in range(0, len(ordered), KEYS_PER_RUN_QUERY):
            if time.monotonic() - started > TICK_BUDGET_S:
                out_of_time = True
                break
            page = ordered[offset : offset + KEYS_PER_RUN_QUERY]
            if len(verdicts.requests) >= max_requests:
                verdicts.deferred.extend(page)
                continue
            page_runs, launched = runs.for_keys(page, cap)
            for key in page:
                judge(candidates[key], page_runs[key], launched[key])
                judged.add(key)
        judged -= set(verdicts.deferred)

        if catch_up_from is not None and not out_of_time:
            for chunk in _catch_up_chunks(engine, partitions_def, code, catch_up_from, now, set(candidates)):
                if len(verdicts.requests) >= max_requests or time.monotonic() - started > TICK_BUDGET_S:
                    break
                for offset in range(0, len(chunk), KEYS_PER_RUN_QUERY):
                    page = chunk[offset : offset + KEYS_PER_RUN_QUERY]
                    if len(verdicts.requests) >= max_requests:
                        break
                    page_runs, launched = runs.for_keys(page, cap)
                    for key in page:
                        if len(verdicts.requests) >= max_requests:
                            break
                        judge(
                            _Candidate(key, "never attempted (catch-up)", 0, None),
                            page_runs[key],
                            launched[key],
                        )

        # -- done but not recorded: a SUCCESS lease with no materialization on this instance ---------------
        asset_events: list[Any] = []
        if asset_key is not None and unrecorded and not out_of_time:
            asset_events.extend(_unrecorded_events(instance, asset_key, unrecorded, holder_runs, sensor_name))
            verdicts.recorded = [str(e.partition) for e in asset_events]

        # -- zombies say so ------------------------------------------------------------------------------
        for run_id, (run, why) in verdicts.zombies.items():
            if run.tags.get(metadata.TAG_OUTCOME) != metadata.LOST:
                instance.add_run_tags(run_id, metadata.run_tags({metadata.LOST: 1}, None))
                context.log.warning(
                    f"run {run_id} is a zombie: Dagster still calls it {run.status.value} but {why}; "
                    "tagged lost (enable run monitoring to have Dagster fail such runs)"
                )

        # -- the cursor: the sweep resumes before the first row not judged --------------------------------
        unjudged = [rid for key, rid in sweep_keys if key in candidates and key not in judged]
        if unjudged:
            next_after = min(unjudged) - 1
            remaining = after_sweep + sum(1 for _, rid in sweep_keys if rid > next_after)
        elif sweep_rows and after_sweep:
            next_after, remaining = sweep_rows[-1].id, after_sweep
        else:  # the sweep reached the end: the next tick starts over from the oldest row
            next_after, remaining = 0, 0
        checks_at = float(cursor.get("checks_at", 0))
        if health is not None and now.timestamp() - checks_at >= checks_every:
            asset_events.extend(health.evaluate(engine))
            checks_at = now.timestamp()
        new_cursor = {
            "checks_at": checks_at,
            "sweep_after": next_after,
            "held_before": next_held_before,
            "capped": dict(sorted(verdicts.capped.items())[:SHOWN_IN_CURSOR]),
            "capped_count": len(verdicts.capped),
        }
        # Log lines are bounded like the rest of the tick: the first few, then how many more.
        for request in verdicts.requests[:SHOWN_IN_MESSAGE]:
            context.log.info(
                f"relaunching {request.partition_key} ({request.tags[TAG_RECONCILE_REASON]}), "
                f"relaunch {request.tags[TAG_RELAUNCH]}"
            )
        if len(verdicts.requests) > SHOWN_IN_MESSAGE:
            context.log.info(f"... and {len(verdicts.requests) - SHOWN_IN_MESSAGE} more relaunches")
        for key, why in sorted(verdicts.capped.items())[:SHOWN_IN_MESSAGE]:
            context.log.warning(
                f"partition {key} of code {code!r} is still undone after {why}; relaunch cap {cap} reached: "
                "fix the cause, then launch it by hand (or `joblease leases fail` and raise the cap)"
            )
        if len(verdicts.capped) > SHOWN_IN_MESSAGE:
            context.log.warning(
                f"... and {len(verdicts.capped) - SHOWN_IN_MESSAGE} more partitions at the relaunch cap "
                "(the first are in the sensor cursor)"
            )
        message = _message(verdicts, cap, max_requests, remaining, out_of_time, ranges_cut)
        if verdicts.requests:  # a tick with requests has no skip message: the summary goes to the log
            context.log.info(message)
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
        or f"Relaunches partitions of lease code {code!r} left undone (failed, expired, dead holder, held, "
        "zombie runs, range keys not attempted"
        + (f", never attempted since {catch_up_from}" if catch_up_from else "")
        + f"); at most {cap} relaunches per partition.",
        **decorator_kwargs,
    )(_evaluate)
    return sensor


def _unrecorded_events(
    instance: dg.DagsterInstance,
    asset_key: dg.AssetKey,
    rows: Sequence[_LeaseRow],
    holder_runs: Mapping[str, dg.DagsterRun],
    sensor_name: str,
) -> list[dg.AssetMaterialization]:
    """Materializations for SUCCESS leases whose run finished (or died) without recording one here."""
    eligible = []
    for row in rows:
        run = holder_runs.get(row.holder_run_id or "")
        if run is None:
            continue  # another deployment's or a non-Dagster holder: not this instance's to record
        if run.status not in holders.FINISHED_RUN_STATUSES and row.idle_ms < MATERIALIZATION_GRACE_MS:
            continue  # it may still be about to log its event
        eligible.append((row, run))
    if not eligible:
        return []
    present = instance.event_log_storage.get_latest_storage_id_by_partition(
        asset_key, DagsterEventType.ASSET_MATERIALIZATION, partitions={row.key for row, _ in eligible}
    )
    return [
        dg.AssetMaterialization(
            asset_key=asset_key,
            partition=row.key,
            description=(
                f"recorded by {sensor_name}: the lease of {row.key} is SUCCESS (attempt {row.attempt}) but "
                f"run {run.run_id} ({run.status.value}) recorded no materialization"
            ),
            metadata={
                metadata.META_WINNER: dg.MetadataValue.dagster_run(run.run_id),
                metadata.META_ATTEMPT: dg.MetadataValue.int(row.attempt),
                metadata.META_OUTCOME: dg.MetadataValue.text("recorded-by-reconciliation"),
            },
        )
        for row, run in eligible
        if row.key not in present
    ]


def _message(
    verdicts: _Verdicts, cap: int, max_requests: int, remaining: int, out_of_time: bool, ranges_cut: bool
) -> str:
    n = SHOWN_IN_MESSAGE
    parts = [f"{len(verdicts.requests)} relaunched"]
    if verdicts.capped:
        parts.append(
            f"CAPPED after {cap} relaunches: "
            + ", ".join(f"{k} ({v})" for k, v in sorted(verdicts.capped.items())[:n])
        )
    if verdicts.waiting:
        parts.append(
            "backing off: " + ", ".join(f"{k} ({v})" for k, v in sorted(verdicts.waiting.items())[:n])
        )
    if verdicts.canceled:
        parts.append(
            "latest run canceled, not relaunched (relaunch_canceled=False): "
            + ", ".join(verdicts.canceled[:n])
        )
    if verdicts.in_flight:
        parts.append(f"a run is already queued or running: {', '.join(verdicts.in_flight[:n])}")
    if verdicts.zombies:
        parts.append(f"{len(verdicts.zombies)} zombie run(s) (STARTED without a live lease) tagged lost")
    if verdicts.recorded:
        parts.append(f"recorded {len(verdicts.recorded)} done partition(s) that had no materialization")
    if verdicts.deferred:
        parts.append(f"{len(verdicts.deferred)} more next tick (max_requests_per_tick={max_requests})")
    if verdicts.live:
        parts.append(f"{verdicts.live} held by a live lease")
    if out_of_time:
        parts.append(f"stopped after {TICK_BUDGET_S:.0f} s; continuing next tick")
    if ranges_cut:
        parts.append(f"only the newest {RANGE_RUNS_PER_TICK} range runs looked at")
    parts.append(f"{remaining} lease rows still to look at in this sweep")
    return "; ".join(parts)
