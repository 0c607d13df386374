"""Leased ops and assets: the body runs under ``run_exclusive(code, partition key)``.

A schedule tick, a backfill of the same partition, a UI re-execution and a run retry all map to one
logical run and one idempotency key; exactly one of them runs the body at a time, and once it succeeded
the others succeed too, as recorded skips. The body writes its domain rows and its outbox row in one
*fenced* transaction, which only commits while the lease is still this run's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import dagster as dg
import sqlalchemy as sa
from dagster import AssetExecutionContext, OpExecutionContext

from dagster_joblease import errors, identity, lease, outbox
from dagster_joblease.dagster import metadata
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.schema import lease_table

__all__ = ["LeasedRun", "leased_asset", "leased_op", "run_leased"]

DEFAULT_RESOURCE_KEY = "joblease"
AnyContext = dg.OpExecutionContext | dg.AssetExecutionContext
F = TypeVar("F", bound=Callable[..., Any])


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


def _current_attempt(engine: sa.Engine, key: str) -> int | None:
    with translate_errors("read a lease"), engine.connect() as connection:
        value: int | None = connection.execute(
            sa.select(lease_table.c.attempt).where(lease_table.c.lock_key == key)
        ).scalar_one_or_none()
    return value


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


def _set_run_tags(context: dg.OpExecutionContext, tags: Mapping[str, str]) -> None:
    # build_op_context runs are ephemeral: there is no stored run to tag.
    if not tags or context.run_id == "EPHEMERAL" or context.instance.get_run_by_id(context.run_id) is None:
        return
    context.instance.add_run_tags(context.run_id, dict(tags))


def run_leased(
    context: AnyContext,
    resource: JobLeaseResource,
    *,
    code: str,
    fn: Callable[[LeasedRun], Any],
    initial: bool = False,
    lease_ms: int | None = None,
    heartbeat_ms: int | None = None,
) -> list[metadata.LeasedResult]:
    """Run ``fn`` once per partition key of this run (one lease per key), or once for an INITIAL job.

    Returns one :class:`LeasedResult` per key and tags the run with the outcome. A key another run
    holds or already finished is a recorded skip, not a failure. ``fn``'s exception fails the lease (the
    next run or retry takes over with the same idempotency key) and propagates.
    """
    op_context = _op_context(context)
    keys = _partition_keys(op_context, code, initial)
    service = resource.lease_service
    results: list[metadata.LeasedResult] = []
    try:
        for key in keys:
            job = (
                identity.JobIdentity.initial(code)
                if key is None
                else identity.JobIdentity.schedule(code, key)
            )
            runs: list[LeasedRun] = []

            def body(held: lease.Lease, key: str | None = key, runs: list[LeasedRun] = runs) -> Any:
                run = LeasedRun(op_context, resource, held, key)
                runs.append(run)
                return fn(run)

            outcome = service.run_exclusive(job, body, lease_ms=lease_ms, heartbeat_ms=heartbeat_ms)
            attempt = (
                outcome.lease.attempt
                if outcome.lease is not None
                else _current_attempt(resource.engine, job.idempotency_key)
            )
            enqueued = runs[0].enqueued if runs else []
            result = metadata.LeasedResult(
                code=job.code,
                partition_key=job.run_key,
                idempotency_key=job.idempotency_key,
                outcome=outcome.outcome,
                attempt=attempt,
                outbox=metadata.outbox_label(enqueued),
                result=outcome.result,
            )
            op_context.log.info(
                f"joblease {job}: {result.outcome} (attempt {attempt}, outbox {result.outbox}, "
                f"key {job.idempotency_key})"
            )
            results.append(result)
    finally:
        _set_run_tags(op_context, metadata.result_tags(results))
    return results


def leased_op(
    *,
    code: str,
    name: str | None = None,
    initial: bool = False,
    resource_key: str = DEFAULT_RESOURCE_KEY,
    lease_ms: int | None = None,
    heartbeat_ms: int | None = None,
    **op_kwargs: Any,
) -> Callable[[Callable[[LeasedRun], Any]], dg.OpDefinition]:
    """Decorate ``fn(run: LeasedRun)`` into an op that runs it under the lease for each partition key.

    The op's output is the list of :class:`LeasedResult` (with output metadata: outcome, idempotency
    key, attempt, outbox result). ``initial=True`` makes it a run-once (``INITIAL``) op instead.

    Example::

        @leased_op(code="daily-billing")
        def bill(run: LeasedRun) -> None:
            with run.transaction() as conn:
                conn.execute(invoices.insert().values(day=run.partition_key))
                run.enqueue_once(conn, topic="billing.daily", payload={"billingDate": run.partition_key})
    """
    identity.JobIdentity.initial(code)  # validate the code at definition time
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
    **asset_kwargs: Any,
) -> Callable[[Callable[[LeasedRun], Any]], dg.AssetsDefinition]:
    """Decorate ``fn(run: LeasedRun)`` into an asset that takes one lease per partition key.

    With ``backfill_policy=BackfillPolicy.single_run()`` a backfill is one run over a partition range;
    each key in it is still its own logical run (its own lease and idempotency key), so keys another run
    already did are skipped and the rest are done.
    """
    identity.JobIdentity.initial(code)
    op_tags = {metadata.TAG_CODE: code, **asset_kwargs.pop("op_tags", {})}

    def decorate(fn: Callable[[LeasedRun], Any]) -> dg.AssetsDefinition:
        def _leased(context: AssetExecutionContext) -> dg.MaterializeResult:  # type: ignore[type-arg]
            results = run_leased(
                context,
                getattr(context.resources, resource_key),
                code=code,
                fn=fn,
                initial=initial,
                lease_ms=lease_ms,
                heartbeat_ms=heartbeat_ms,
            )
            return dg.MaterializeResult(metadata=metadata.output_metadata(results))

        asset_def: dg.AssetsDefinition = dg.asset(
            name=name or fn.__name__,
            description=fn.__doc__,
            partitions_def=partitions_def,
            backfill_policy=backfill_policy,
            required_resource_keys={resource_key},
            op_tags=op_tags,
            **asset_kwargs,
        )(real_annotations(_leased, dg.MaterializeResult, context=AssetExecutionContext))
        return asset_def

    return decorate
