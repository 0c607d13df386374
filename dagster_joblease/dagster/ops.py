"""Leased ops and assets: the body runs under ``run_exclusive(code, partition key)``.

A schedule tick, a backfill of the same partition, a UI re-execution and a run retry all map to one
logical run and one idempotency key; exactly one of them runs the body at a time. The others mirror the
truth instead of claiming success:

- the partition already succeeded: a recorded skip (``skipped-succeeded``, tagged with the winner's run);
- a live lease holds it: wait for the holder (bounded, ``held_wait_ms``), re-checking on the database
  clock. If the holder succeeds, skip; if it fails, or its lease expires, take over (``reclaimed``); if the
  holder's Dagster run is finished on this instance and its heartbeat is stale (older than twice the
  interval the *holder* recorded on its row, see :mod:`dagster_joblease.staleness`), take the lease from
  the dead holder at once; if it is still held when the wait
  ends, fail retryably (``held``).

The body writes its domain rows and its outbox row in one *fenced* transaction, which only commits while
the lease is still this run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import dagster as dg
import sqlalchemy as sa
from dagster import AssetExecutionContext, OpExecutionContext

from dagster_joblease import errors, identity, lease, options, outbox, staleness
from dagster_joblease.dagster import holders, metadata
from dagster_joblease.dagster.resource import JobLeaseResource, check_held_wait_ms
from dagster_joblease.storage.clock import ms_until
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.schema import lease_table

__all__ = ["LeasedRun", "leased_asset", "leased_op", "run_leased"]

DEFAULT_RESOURCE_KEY = "joblease"
AnyContext = dg.OpExecutionContext | dg.AssetExecutionContext
F = TypeVar("F", bound=Callable[..., Any])
EPHEMERAL_RUN_ID = "EPHEMERAL"
_FIRST_POLL_S = 0.05
_MAX_POLL_S = 1.0


class LeasedRun:
    """What a leased body gets: the lease, the partition key, and a fenced domain+outbox transaction."""

    def __init__(
        self,
        context: dg.OpExecutionContext,
        resource: JobLeaseResource,
        held: lease.Lease,
        partition_key: str | None,
    ) -> None:
        self.context = context
        self.resource = resource
        self.lease = held
        self.partition_key = partition_key
        self.enqueued: list[bool] = []

    @property
    def idempotency_key(self) -> str:
        return self.lease.idempotency_key

    @property
    def log(self) -> Any:
        return self.context.log

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sa.Connection]:
        """One transaction for the domain rows and the outbox row, committed only while the lease is ours.

        If the lease was reclaimed, finished or expired, :class:`LostLeaseError` is raised and nothing
        of the transaction is written.
        """
        with self.resource.lease_service.fenced_transaction(self.lease) as connection:
            yield connection

    def enqueue_once(
        self,
        connection: sa.Connection,
        *,
        topic: str,
        payload: Any,
        idempotency_key: str | None = None,
    ) -> bool:
        """Enqueue the run's effect (keyed by the run's idempotency key unless another is given)."""
        inserted = outbox.enqueue_once(
            connection,
            idempotency_key=idempotency_key or self.idempotency_key,
            topic=topic,
            payload=payload,
        )
        self.enqueued.append(inserted)
        return inserted


def real_annotations(fn: F, returns: Any = None, **annotations: Any) -> F:
    """Give Dagster real classes to inspect: with postponed annotations it would see strings."""
    fn.__annotations__.update(annotations)
    if returns is not None:
        fn.__annotations__["return"] = returns
    return fn


def _op_context(context: AnyContext) -> dg.OpExecutionContext:
    if isinstance(context, dg.AssetExecutionContext):
        return context.op_execution_context
    return context


@dataclasses.dataclass(frozen=True)
class _Row:
    """A lease row as a waiter sees it; ages and time left are measured on the database clock."""

    status: str
    attempt: int
    owner_token: str
    holder: str | None
    heartbeat_age_ms: int
    remaining_ms: int
    heartbeat_ms: int | None  #: the holder's recorded interval (None: a row from before migration 0002)


def _read_row(engine: sa.Engine, key: str) -> _Row | None:
    t = lease_table
    stmt = sa.select(
        t.c.status,
        t.c.attempt,
        t.c.owner_token,
        t.c.holder,
        (-ms_until(t.c.heartbeat_at)).label("heartbeat_age_ms"),
        ms_until(t.c.expires_at).label("remaining_ms"),
        t.c.heartbeat_ms,
    ).where(t.c.lock_key == key)
    with translate_errors("read a lease"), engine.connect() as connection:
        row = connection.execute(stmt).first()
    return None if row is None else _Row(*row)


def _partition_keys(context: dg.OpExecutionContext, code: str, initial: bool) -> list[str | None]:
    if initial:
        return [None]
    if context.has_partition_key_range:  # a single-run backfill: one lease per key in the range
        return list(context.partition_keys)
    if context.has_partition_key:
        return [context.partition_key]
    raise errors.ConfigurationError(
        f"leased op for code {code!r} ran without a partition: a SCHEDULE lease needs a partition key "
        "as its run key. Give the job or asset a partitions_def, or pass initial=True for a job that "
        "runs once, forever"
    )


def _stored_run(context: dg.OpExecutionContext) -> dg.DagsterRun | None:
    # build_op_context runs are ephemeral: there is no stored run to tag.
    if context.run_id == EPHEMERAL_RUN_ID:
        return None
    return context.instance.get_run_by_id(context.run_id)


def _set_run_tags(context: dg.OpExecutionContext, tags: dict[str, str]) -> None:
    if tags and _stored_run(context) is not None:
        context.instance.add_run_tags(context.run_id, tags)


def _leased_op_names(context: dg.OpExecutionContext) -> list[str]:
    """Names of the leased ops in this run's job (ops carrying the ``joblease/code`` op tag)."""
    try:
        node_defs = context.job_def.all_node_defs
    except Exception:  # direct invocation has no job
        return []
    return [d.name for d in node_defs if isinstance(d, dg.OpDefinition) and metadata.TAG_CODE in d.tags]


def _aggregate_op_outcomes(context: dg.OpExecutionContext) -> None:
    """Several leased ops: ``joblease/outcome`` is the most severe of their ``joblease/outcome.<op>``.

    Dagster rewrites a run's tags read-modify-write, so two steps finishing at once can overwrite each
    other's aggregate; each step rewrites it until a re-read agrees, which leaves the last writer with
    every op's outcome.
    """
    prefix = metadata.TAG_OUTCOME + "."
    for _ in range(5):
        run = _stored_run(context)
        if run is None:
            return
        worst = metadata.worst_outcome(v for k, v in run.tags.items() if k.startswith(prefix))
        if run.tags.get(metadata.TAG_OUTCOME) == worst:
            return
        context.instance.add_run_tags(context.run_id, {metadata.TAG_OUTCOME: worst})


@dataclasses.dataclass
class _Step:
    """What every key of one leased step shares."""

    context: dg.OpExecutionContext
    resource: JobLeaseResource
    service: lease.LeaseService
    fn: Callable[[LeasedRun], Any]
    timing: options.LeaseTiming
    held_wait_ms: int
    holder: str | None
    run_id: str | None

    def stale_ms(self, row: _Row) -> int | None:
        """A finished run's holder is dead once its heartbeat is older than two of *its* intervals
        (recorded on its row; None: it never heartbeats, only expiry frees it). A row from before
        migration 0002 keeps the old rule: two of this step's intervals."""
        return staleness.stale_after_ms(row.heartbeat_ms, legacy_ms=2 * self.timing.heartbeat_ms)


def _winner_run_id(holder: str | None) -> str | None:
    decoded = holders.decode_holder(holder)
    return None if decoded is None else decoded.run_id


def _tag_dead_holder_run(instance: dg.DagsterInstance, row: _Row, reason: str) -> None:
    """A SIGKILLed run cannot tag itself: the run that took its lease says ``lost`` for it."""
    run_id = _winner_run_id(row.holder)
    if run_id is None or instance.get_run_by_id(run_id) is None:
        return
    instance.add_run_tags(
        run_id,
        {
            metadata.TAG_OUTCOME: metadata.LOST,
            metadata.TAG_ATTEMPT: str(row.attempt),
            metadata.TAG_ERROR: metadata.bound_tag_text(reason),
            metadata.TAG_HOLDER: row.holder or metadata.NONE,
            metadata.TAG_WINNER_RUN_ID: metadata.NONE,
            # It died mid-step: whether its fenced transaction committed an outbox row is not known here.
            metadata.TAG_OUTBOX: metadata.OUTBOX_UNKNOWN,
        },
    )


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _run_key(step: _Step, job: identity.JobIdentity, results: list[metadata.LeasedResult]) -> None:
    """Settle one key and append its result; re-raise the body's exception after recording it."""
    runs: list[LeasedRun] = []

    def body(held: lease.Lease) -> Any:
        run = LeasedRun(step.context, step.resource, held, job.run_key)
        runs.append(run)
        return step.fn(run)

    def result(outcome: str, attempt: int | None, **extra: Any) -> metadata.LeasedResult:
        enqueued = runs[0].enqueued if runs else []
        return metadata.LeasedResult(
            code=job.code,
            partition_key=job.run_key,
            idempotency_key=job.idempotency_key,
            outcome=outcome,
            attempt=attempt,
            outbox=metadata.outbox_label(enqueued),
            **extra,
        )

    def attempt_so_far() -> int | None:
        if runs:
            return runs[0].lease.attempt
        try:
            row = _read_row(step.resource.engine, job.idempotency_key)
        except errors.StorageError:
            return None
        return None if row is None else row.attempt

    log = step.context.log
    deadline = time.monotonic() + step.held_wait_ms / 1000
    delay = _FIRST_POLL_S
    announced = False
    while True:
        try:
            outcome = step.service.run_exclusive(
                job, body, lease_ms=step.timing.lease_ms, heartbeat_ms=step.timing.heartbeat_ms
            )
        except errors.LostLeaseError as exc:
            results.append(
                result(metadata.LOST, attempt_so_far(), holder=step.holder, error=_error_text(exc))
            )
            raise
        except Exception as exc:
            results.append(
                result(metadata.FAILED, attempt_so_far(), holder=step.holder, error=_error_text(exc))
            )
            raise
        except BaseException as exc:  # Dagster's run termination: run_exclusive released the lease
            results.append(
                result(
                    metadata.FAILED,
                    attempt_so_far(),
                    holder=step.holder,
                    error=f"interrupted by {type(exc).__name__}; the lease was released",
                )
            )
            raise
        if outcome.lease is not None:
            results.append(
                result(
                    metadata.RECLAIMED if outcome.lease.reclaimed else metadata.WON,
                    outcome.lease.attempt,
                    result=outcome.result,
                    holder=step.holder,
                    winner_run_id=step.run_id,
                )
            )
            return
        row = _read_row(step.resource.engine, job.idempotency_key)
        if row is not None and row.status == lease.LeaseStatus.SUCCESS.value:
            results.append(
                result(
                    metadata.SKIPPED_SUCCEEDED,
                    row.attempt,
                    holder=row.holder,
                    winner_run_id=_winner_run_id(row.holder),
                )
            )
            return
        if row is not None and row.status == lease.LeaseStatus.RUNNING.value:
            stale_ms = step.stale_ms(row)
            if (
                stale_ms is not None
                and staleness.is_stale(row.heartbeat_age_ms, stale_ms)
                and holders.holder_run_finished(step.context.instance, row.holder)
            ):
                status = holders.holder_run_status(step.context.instance, row.holder)
                reason = (
                    f"attempt {row.attempt}: holder {row.holder} is dead (its Dagster run is "
                    f"{status.value if status else 'finished'} and its last heartbeat was "
                    f"{row.heartbeat_age_ms} ms ago); taken over by run {step.run_id or step.holder}"
                )
                if step.service.fail_dead_holder(
                    job,
                    attempt=row.attempt,
                    owner_token=row.owner_token,
                    stale_ms=stale_ms,
                    reason=reason,
                ):
                    log.warning(f"joblease {job}: {reason}")
                    _tag_dead_holder_run(step.context.instance, row, reason)
                continue  # reclaim it now (or see who did)
            if time.monotonic() >= deadline:
                error = (
                    f"partition {job.run_key or '(initial)'} of code {job.code!r} is still held by "
                    f"{row.holder} (attempt {row.attempt}, {max(row.remaining_ms, 0)} ms left on its lease) "
                    f"after waiting {step.held_wait_ms} ms; retry later"
                )
                results.append(result(metadata.HELD, row.attempt, holder=row.holder, error=error))
                return
            if not announced:
                announced = True
                log.info(
                    f"joblease {job}: held by {row.holder} (attempt {row.attempt}); waiting up to "
                    f"{step.held_wait_ms} ms for it to finish"
                )
        elif time.monotonic() >= deadline:  # FAIL or gone, yet other claims kept winning the race
            error = (
                f"partition {job.run_key or '(initial)'} of code {job.code!r} could not be claimed "
                f"within {step.held_wait_ms} ms; retry later"
            )
            results.append(result(metadata.HELD, row.attempt if row else None, error=error))
            return
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 2, _MAX_POLL_S)


def run_leased(
    context: AnyContext,
    resource: JobLeaseResource,
    *,
    code: str,
    fn: Callable[[LeasedRun], Any],
    initial: bool = False,
    lease_ms: int | None = None,
    heartbeat_ms: int | None = None,
    held_wait_ms: int | None = None,
) -> list[metadata.LeasedResult]:
    """Run ``fn`` once per partition key of this run (one lease per key), or once for an INITIAL job.

    Returns one :class:`LeasedResult` per key and tags the run with the outcome (``pending`` first, so
    tags copied from a parent run never stand). A key that already succeeded is a recorded skip. A key
    held by a live lease is waited for (``held_wait_ms``, default the resource's, 5 minutes); if it is
    still held then, the step fails with :class:`dagster.Failure` (outcome ``held``; retryable). ``fn``'s
    exception fails the lease (the next run or retry takes over with the same idempotency key) and
    propagates; the other keys of a range are not attempted then.
    """
    results: list[metadata.LeasedResult] = []
    _settle(context, resource, code, fn, initial, lease_ms, heartbeat_ms, held_wait_ms, results)
    _raise_if_held(results)
    return results


def _settle(
    context: AnyContext,
    resource: JobLeaseResource,
    code: str,
    fn: Callable[[LeasedRun], Any],
    initial: bool,
    lease_ms: int | None,
    heartbeat_ms: int | None,
    held_wait_ms: int | None,
    results: list[metadata.LeasedResult],
) -> None:
    """Settle every key of this step into ``results`` and tag the run (see :func:`run_leased`)."""
    op_context = _op_context(context)
    keys = _partition_keys(op_context, code, initial)
    jobs = [
        identity.JobIdentity.initial(code) if k is None else identity.JobIdentity.schedule(code, k)
        for k in keys
    ]
    timing = options.resolve_timing(lease_ms, heartbeat_ms, defaults=resource.timing())
    wait_ms = resource.resolved_held_wait_ms() if held_wait_ms is None else check_held_wait_ms(held_wait_ms)
    run_id = None if op_context.run_id == EPHEMERAL_RUN_ID else op_context.run_id
    holder = (
        lease.default_holder()
        if run_id is None
        else holders.encode_holder(resource.resolved_deployment(op_context.instance), run_id)
    )
    service = lease.LeaseService(
        resource.engine, lease_ms=timing.lease_ms, heartbeat_ms=timing.heartbeat_ms, holder=holder
    )
    op_name = op_context.op_def.name
    several_ops = len(_leased_op_names(op_context)) > 1
    step = _Step(op_context, resource, service, fn, timing, wait_ms, holder, run_id)
    start_tags = metadata.pending_tags(code, jobs, several_ops=several_ops, op_name=op_name)
    if run_id is not None and op_context.run.parent_run_id is not None:
        start_tags.update(metadata.INHERITED_RECONCILE_TAGS)
    _set_run_tags(op_context, start_tags)
    if several_ops:
        _aggregate_op_outcomes(op_context)
    try:
        for job in jobs:
            settled = len(results)
            try:
                _run_key(step, job, results)
            except BaseException as exc:
                if len(results) == settled:
                    # Failed outside the body (e.g. the database went away while waiting): still say so.
                    results.append(
                        metadata.LeasedResult(
                            code=job.code,
                            partition_key=job.run_key,
                            idempotency_key=job.idempotency_key,
                            outcome=metadata.FAILED,
                            attempt=None,
                            outbox=metadata.OUTBOX_NOT_ENQUEUED,
                            holder=holder,
                            error=_error_text(exc),
                        )
                    )
                raise
            last = results[-1]
            op_context.log.info(
                f"joblease {job}: {last.outcome} (attempt {last.attempt}, outbox {last.outbox}, "
                f"holder {last.holder}, key {job.idempotency_key})"
            )
    finally:
        tags = metadata.result_tags(results, own_holder=holder, several_ops=several_ops, op_name=op_name)
        _set_run_tags(op_context, tags)
        if several_ops:
            _aggregate_op_outcomes(op_context)


def _raise_if_held(results: list[metadata.LeasedResult]) -> None:
    """A key still held after the wait fails the step, retryably: the run must not claim success."""
    held = [r for r in results if r.outcome == metadata.HELD]
    if held:
        raise dg.Failure(
            description="; ".join(r.error or "" for r in held)
            + ". The run did not claim success: it can be retried (Dagster run retries, a re-execution, "
            "or the reconciliation sensor).",
            metadata={
                metadata.TAG_OUTCOME: metadata.HELD,
                **{str(r.partition_key): r.holder or "" for r in held},
            },
            allow_retries=True,
        )


def leased_op(
    *,
    code: str,
    name: str | None = None,
    initial: bool = False,
    resource_key: str = DEFAULT_RESOURCE_KEY,
    lease_ms: int | None = None,
    heartbeat_ms: int | None = None,
    held_wait_ms: int | None = None,
    **op_kwargs: Any,
) -> Callable[[Callable[[LeasedRun], Any]], dg.OpDefinition]:
    """Decorate ``fn(run: LeasedRun)`` into an op that runs it under the lease for each partition key.

    The op's output is the list of :class:`LeasedResult` (with output metadata: outcome, idempotency
    key, attempt, holder, winner run, outbox result). ``initial=True`` makes it a run-once (``INITIAL``)
    op instead. ``held_wait_ms`` bounds the wait for a live holder (default: the resource's, 5 minutes).

    Example::

        @leased_op(code="daily-billing")
        def bill(run: LeasedRun) -> None:
            with run.transaction() as conn:
                conn.execute(invoices.insert().values(day=run.partition_key))
                run.enqueue_once(conn, topic="billing.daily", payload={"billingDate": run.partition_key})
    """
    identity.JobIdentity.initial(code)  # validate the code and the wait at definition time
    if held_wait_ms is not None:
        check_held_wait_ms(held_wait_ms)
    tags = {metadata.TAG_CODE: code, **op_kwargs.pop("tags", {})}

    def decorate(fn: Callable[[LeasedRun], Any]) -> dg.OpDefinition:
        def _leased(context: OpExecutionContext) -> dg.Output[list[metadata.LeasedResult]]:
            results = run_leased(
                context,
                getattr(context.resources, resource_key),
                code=code,
                fn=fn,
                initial=initial,
                lease_ms=lease_ms,
                heartbeat_ms=heartbeat_ms,
                held_wait_ms=held_wait_ms,
            )
            return dg.Output(results, metadata=metadata.output_metadata(results))

        op_def: dg.OpDefinition = dg.op(
            name=name or fn.__name__,
            description=fn.__doc__,
            required_resource_keys={resource_key},
            tags=tags,
            **op_kwargs,
        )(real_annotations(_leased, dg.Output[list[metadata.LeasedResult]], context=OpExecutionContext))
        return op_def

    return decorate


def _has_materialization(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str | None) -> bool:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=None if partition is None else [partition]),
        limit=1,
    ).records
    return bool(records)


def _to_materialize(context: AssetExecutionContext, results: list[metadata.LeasedResult]) -> list[bool]:
    """Per key: record a materialization here? Yes when this run did it; for a skip only when this
    instance has none for the partition (the winner ran elsewhere), so automation sees it done once and
    nothing downstream is triggered twice."""
    return [
        r.acquired
        or (r.skipped and not _has_materialization(context.instance, context.asset_key, r.partition_key))
        for r in results
    ]


def leased_asset(
    *,
    code: str,
    partitions_def: dg.PartitionsDefinition | None = None,
    name: str | None = None,
    initial: bool = False,
    resource_key: str = DEFAULT_RESOURCE_KEY,
    backfill_policy: dg.BackfillPolicy | None = None,
    lease_ms: int | None = None,
    heartbeat_ms: int | None = None,
    held_wait_ms: int | None = None,
    **asset_kwargs: Any,
) -> Callable[[Callable[[LeasedRun], Any]], dg.AssetsDefinition]:
    """Decorate ``fn(run: LeasedRun)`` into an asset that takes one lease per partition key.

    A partition is materialized only by a run whose partition actually succeeded: a won or reclaimed
    key materializes; a skip adds no second materialization where the winner's is already recorded on
    this instance, and records one (pointing at the winner) where there is none, e.g. when another
    deployment won it. When only some keys of the run materialize, each is recorded on its own and the
    asset's output is not produced, so downstream steps of this run do not run on a skip. ``held`` and
    failures materialize nothing.

    With ``backfill_policy=BackfillPolicy.single_run()`` a backfill is one run over a partition range;
    each key in it is still its own logical run (its own lease and idempotency key).
    """
    identity.JobIdentity.initial(code)
    if held_wait_ms is not None:
        check_held_wait_ms(held_wait_ms)
    op_tags = {metadata.TAG_CODE: code, **asset_kwargs.pop("op_tags", {})}

    def decorate(fn: Callable[[LeasedRun], Any]) -> dg.AssetsDefinition:
        def _leased(context: AssetExecutionContext) -> Iterator[dg.MaterializeResult[Any]]:
            results: list[metadata.LeasedResult] = []
            failure: Exception | None = None
            try:
                _settle(
                    context,
                    getattr(context.resources, resource_key),
                    code,
                    fn,
                    initial,
                    lease_ms,
                    heartbeat_ms,
                    held_wait_ms,
                    results,
                )
            except Exception as exc:  # record what the earlier keys of a range did, then fail
                failure = exc
            chosen = _to_materialize(context, results)
            if failure is None and all(chosen):
                yield dg.MaterializeResult(metadata=metadata.output_metadata(results))
                return
            for result, materialize in zip(results, chosen, strict=True):
                if materialize:
                    context.log_event(
                        dg.AssetMaterialization(
                            asset_key=context.asset_key,
                            partition=result.partition_key,
                            metadata=metadata.output_metadata([result]),
                        )
                    )
            if failure is not None:
                raise failure
            _raise_if_held(results)

        asset_def: dg.AssetsDefinition = dg.asset(
            name=name or fn.__name__,
            description=fn.__doc__,
            partitions_def=partitions_def,
            backfill_policy=backfill_policy,
            required_resource_keys={resource_key},
            op_tags=op_tags,
            output_required=False,
            **asset_kwargs,
        )(real_annotations(_leased, Iterator[dg.MaterializeResult[Any]], context=AssetExecutionContext))
        return asset_def

    return decorate
