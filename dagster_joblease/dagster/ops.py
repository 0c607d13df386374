"""Leased ops and assets: the body runs under ``run_exclusive(code, partition key)``.

A schedule tick, a backfill of the same partition, a UI re-execution and a run retry all map to one
logical run and one idempotency key; exactly one of them runs the body at a time. The others mirror the
truth instead of claiming success:

- the partition already succeeded: a recorded skip (``skipped-succeeded``, naming the winner's run);
- a live lease holds it: wait for the holder (bounded, ``held_wait_ms``), re-checking on the database
  clock. If the holder succeeds, skip; if it fails, or its lease expires, take over (``reclaimed``); if the
  holder's Dagster run is finished on this instance and its heartbeat is stale (older than twice the
  interval the *holder* recorded on its row, see :mod:`dagster_joblease.staleness`), take the lease from
  the dead holder at once; if it is still held when the wait
  ends, fail retryably (``held``).

The body writes its domain rows and its outbox row in one *fenced* transaction, which only commits while
the lease is still this run's.

**Range runs** (a single-run backfill: ``BackfillPolicy.single_run()``) cover many keys, each its own
logical run (own lease, own idempotency key). Every key ends with an outcome from
:mod:`dagster_joblease.dagster.metadata` (``won``, ``reclaimed``, ``skipped-succeeded``, ``held``,
``failed``, ``lost``, ``not-attempted``), recorded in the step's metadata and counted in the run's tags.

- *Per-key mode* (the default): the body is called once per key, as for a single partition. Every key is
  tried once before any waiting; keys held by a live holder are then waited for together, within one
  ``held_wait_ms``. A key whose body raises fails its own lease only: the range goes on, unless
  ``max_failures_in_a_row`` keys (default :data:`DEFAULT_MAX_FAILURES_IN_A_ROW`) fail one after the other
  (a broken body or an unreachable database would fail them all); the keys after that are
  ``not-attempted``.
- *Batch mode* (``batch=True``): the body is called with a :class:`LeasedBatch`, the keys this run won
  (claimed in one statement, ``run.partition_keys``), and writes them in one fenced transaction
  (``run.transaction()``, ``run.enqueue_many``); heartbeats and completion are one statement per set.
  Keys already succeeded are skipped; keys held by a live holder are claimed again until the bounded
  wait ends, and the keys won then are given to the body in a further call (each call its own set). A
  failing call fails its whole set (retryable) and ends the range.

Either way the step then succeeds only if every key is done (by this run, or provably by another); it
fails otherwise, naming the keys not done, so the run never says green for undone work and the
reconciliation sensor can redo them. Dagster's run termination (``DagsterExecutionInterruptedError``)
stops the range at once: the current key's lease is released, the rest are ``not-attempted``, and what
this run did is recorded (an asset's materializations yielded) before the interrupt is re-raised. A
SIGKILL cannot be covered from inside the run: reconciliation repairs it from the lease table.

The claiming, waiting, taking over and every key's outcome are the core's wait engine
(:mod:`dagster_joblease.waiting`, no Dagster in it), used by single, per-key and batch runs alike; this module
gives it the body, the Dagster side of a dead holder (its run finished; its tags then say ``lost``) and the
step's log, and records what it reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, TypeVar, cast

import dagster as dg
import sqlalchemy as sa
from dagster import AssetExecutionContext, OpExecutionContext

from dagster_joblease import batch as batch_leases
from dagster_joblease import checks, errors, identity, lease, options, outbox, waiting
from dagster_joblease.dagster import holders, metadata, not_run_coverage
from dagster_joblease.dagster.internals import EngineEventData  # a step engine event with metadata
from dagster_joblease.dagster.key_context import KeyContext
from dagster_joblease.dagster.resource import JobLeaseResource, check_held_wait_ms

__all__ = [
    "DEFAULT_MAX_FAILURES_IN_A_ROW",
    "AssetRecording",
    "LeasedBatch",
    "LeasedRun",
    "asset_recording",
    "leased_asset",
    "leased_op",
    "run_leased",
    "settle_run_tags",
    "step_records",
]

DEFAULT_RESOURCE_KEY = "joblease"
#: Per-key mode stops a range after this many keys failed one after the other (the rest: not-attempted).
DEFAULT_MAX_FAILURES_IN_A_ROW = 3
AnyContext = dg.OpExecutionContext | dg.AssetExecutionContext
F = TypeVar("F", bound=Callable[..., Any])
EPHEMERAL_RUN_ID = "EPHEMERAL"
#: Dagster's tag naming the backfill a run belongs to.
BACKFILL_TAG = "dagster/backfill"
#: A range logs one line per key up to this many keys, then a summary.
_LOG_KEYS = 50
_SETTLE_ROUNDS = 10


class LeasedRun:
    """What a leased body gets: the lease, the partition key, and a fenced domain+outbox transaction.

    ``context`` is the step's context; in a range run, a :class:`~dagster_joblease.dagster.key_context.
    KeyContext` of it for this key (``partition_key``, ``partition_time_window`` … are the key's).
    """

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
        #: what ``enqueue_once`` returned, for rows that are written: those of a :meth:`transaction` that
        #: committed (a refused or rolled-back one adds none), and those on a connection of the body's own
        self.enqueued: list[bool] = []
        self._uncommitted: list[bool] | None = None

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
        pending: list[bool] = []
        self._uncommitted = pending
        try:
            with self.resource.lease_service.fenced_transaction(self.lease) as connection:
                yield connection
        finally:
            self._uncommitted = None
        self.enqueued.extend(pending)  # committed: its rows exist, whatever happens to the lease next

    def enqueue_once(
        self,
        connection: sa.Connection,
        *,
        topic: str,
        payload: Any,
        idempotency_key: str | None = None,
        ordering_key: str | None = None,
    ) -> bool:
        """Enqueue the run's effect (keyed by the run's idempotency key unless another is given);
        ``ordering_key``: delivered after the key's earlier rows, one at a time (see
        :func:`dagster_joblease.outbox.enqueue_once`)."""
        inserted = outbox.enqueue_once(
            connection,
            idempotency_key=idempotency_key or self.idempotency_key,
            topic=topic,
            payload=payload,
            ordering_key=ordering_key,
        )
        (self.enqueued if self._uncommitted is None else self._uncommitted).append(inserted)
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


def _is_range(context: dg.OpExecutionContext) -> bool:
    try:
        return context.has_partition_key_range
    except Exception:  # direct invocation (build_op_context) without a run: not a range
        return False


def _partitions_def(context: AnyContext) -> dg.PartitionsDefinition | None:
    op_context = _op_context(context)
    try:
        if op_context.has_assets_def:
            return op_context.assets_def.partitions_def
        return op_context.job_def.partitions_def
    except Exception:  # direct invocation (build_op_context) has no job: nothing to check against
        return None


def _check_partition_keys(context: AnyContext, code: str, keys: Sequence[str | None]) -> None:
    """Every key must be a partition of the job's or asset's partitions definition, before any lease.

    Dynamic partitions are checked against this instance's keys. A run whose ``dagster/partition`` tag was
    typed by hand (``dagster job execute --tags``) reaches the step unchecked by Dagster.
    """
    wanted = [k for k in keys if k is not None]
    partitions_def = _partitions_def(context) if wanted else None
    if partitions_def is None:
        return
    instance = _op_context(context).instance
    try:
        with dg.partition_loading_context(dynamic_partitions_store=instance):
            missing = [k for k in wanted if not partitions_def.has_partition_key(k)]
    except Exception as exc:  # e.g. a malformed key a time-window definition cannot parse
        raise _invalid_keys(code, wanted[:1], partitions_def, exc) from exc
    if missing:
        raise _invalid_keys(code, missing, partitions_def, None)


def _invalid_keys(
    code: str, missing: Sequence[str], partitions_def: dg.PartitionsDefinition, cause: Exception | None
) -> dg.Failure:
    shown = ", ".join(repr(k) for k in missing[:5])
    if len(missing) > 5:
        shown += f" and {len(missing) - 5} more"
    dynamic = isinstance(partitions_def, dg.DynamicPartitionsDefinition)
    described = f"{type(partitions_def).__name__} ({str(partitions_def).rstrip('.')})"
    why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    hint = (
        "; add it to this instance first (instance.add_dynamic_partitions or a sensor's "
        "dynamic_partitions_requests)"
        if dynamic
        else ""
    )
    return dg.Failure(
        description=(
            f"partition key {shown} of lease code {code!r} is not a partition of {described}{why}: "
            f"nothing was leased or enqueued. Launch the run with a key of that partitions definition{hint}"
        ),
        metadata={"joblease/invalid_keys": dg.MetadataValue.json(list(missing[:100]))},
        allow_retries=False,
    )


def _stored_run(context: dg.OpExecutionContext) -> dg.DagsterRun | None:
    # build_op_context runs are ephemeral: there is no stored run to tag.
    if context.run_id == EPHEMERAL_RUN_ID:
        return None
    return context.instance.get_run_by_id(context.run_id)


def _step_key(context: dg.OpExecutionContext) -> str:
    try:
        return context.get_step_execution_context().step.key
    except Exception:
        return context.op_def.name


def _report_step(
    context: dg.OpExecutionContext, results: Sequence[metadata.LeasedResult]
) -> dg.DagsterRun | None:
    """Log the step's own truth as an engine event of the step: its outcome counts, winner, every key.

    These events, not the run's tags, are what :func:`settle_run_tags` computes the tags from.
    """
    run = _stored_run(context)
    if run is None:
        return None
    meta = metadata.step_metadata(results)
    meta[metadata.META_OP] = dg.MetadataValue.text(context.op_def.name)
    meta[metadata.META_OUTCOMES] = dg.MetadataValue.json(metadata.outcome_counts(results))
    counts = metadata.format_counts(metadata.outcome_counts(results))
    skipped = metadata.skip_summary(results)
    context.instance.report_engine_event(
        f"{metadata.STEP_EVENT_MESSAGE}: {counts}" + (f" ({skipped})" if skipped else ""),
        run,
        EngineEventData(metadata=meta),
        step_key=_step_key(context),
    )
    return run


def _plain(value: object) -> object:
    """A metadata value as plain data (a run link as its run id)."""
    if isinstance(value, dg.DagsterRunMetadataValue):
        return value.run_id
    return getattr(value, "value", value)


def step_records(instance: dg.DagsterInstance, run_id: str) -> dict[str, dict[str, object]]:
    """Each leased step's latest record in a run, by step key: its metadata as plain values.

    Keys are the :data:`~dagster_joblease.dagster.metadata.META_OUTCOME`-style names (``joblease/outcome``,
    ``joblease/winner`` as a run id, ``joblease/attempt``, ``joblease/outbox``, ``joblease/outcomes`` …).
    This is the per-op truth the run's tags are computed from.
    """
    latest: dict[str, dict[str, object]] = {}
    records = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT).records
    for record in records:
        event = record.event_log_entry.dagster_event
        if event is None or not (event.message or "").startswith(metadata.STEP_EVENT_MESSAGE):
            continue
        data = event.engine_event_data.metadata if event.engine_event_data else {}
        latest[event.step_key or ""] = {k: _plain(v) for k, v in data.items()}
    return latest


def _tags_from_events(instance: dg.DagsterInstance, run_id: str) -> dict[str, str] | None:
    """The run's :data:`~metadata.STEP_TAGS` from its leased steps' engine events (latest per step)."""
    steps = step_records(instance, run_id)
    counts: dict[str, int] = {}
    winners: set[str] = set()
    seen = False
    for record in steps.values():
        outcomes = record.get(metadata.META_OUTCOMES)
        if not isinstance(outcomes, dict):
            continue
        seen = True
        for outcome, n in outcomes.items():
            counts[str(outcome)] = counts.get(str(outcome), 0) + int(n)
        winner = record.get(metadata.META_WINNER)
        if isinstance(winner, str) and winner != metadata.NONE and counts:
            winners.add(winner)
    if not seen:
        return None
    winner_label = None if not winners else winners.pop() if len(winners) == 1 else metadata.MULTIPLE
    return metadata.run_tags(counts, winner_label)


def settle_run_tags(instance: dg.DagsterInstance, run_id: str) -> dict[str, str] | None:
    """Write the run's ``joblease/*`` step tags from its leased steps' own records (the one place).

    Each leased step records its outcome counts in an engine event before calling this, and the tags are
    computed from all such events of the run, never from the tags themselves. ``add_run_tags`` is a
    read-modify-write of the whole tag set, so two steps writing at once can overwrite each other: each
    caller re-reads after its write and writes again until the stored tags are what the events say. The
    last writer's re-read sees every step's event (each was logged before its step's first write), so the
    stored tags end up complete. Returns the tags, or ``None`` when the run has no leased step's record.
    """
    wanted: dict[str, str] | None = None
    for _ in range(_SETTLE_ROUNDS):
        run = instance.get_run_by_id(run_id)
        wanted = _tags_from_events(instance, run_id)
        if run is None or wanted is None:
            return wanted
        if all(run.tags.get(k) == v for k, v in wanted.items()):
            return wanted
        instance.add_run_tags(run_id, wanted)
    return wanted


@dataclasses.dataclass
class _Step:
    """What every key of one leased step shares: the Dagster side, and the engine's :class:`Wait`."""

    context: dg.OpExecutionContext
    resource: JobLeaseResource
    fn: Callable[[LeasedRun], Any]
    run_id: str | None
    wait: waiting.Wait
    #: a range run: each key's body sees a :class:`KeyContext` (its own partition), not the range's
    ranged: bool = False
    partitions_def: dg.PartitionsDefinition | None = None

    @property
    def holder(self) -> str | None:
        return self.wait.holder


def _key_context(step: _Step, run_key: str | None) -> dg.OpExecutionContext:
    """The context a per-key body sees: in a range run, the step's context as this key's partition."""
    if run_key is None or not step.ranged:
        return step.context
    # A view that behaves as the step's context (it delegates everything but the partition answers).
    return cast(dg.OpExecutionContext, KeyContext(step.context, run_key, step.partitions_def))


def _winner_run_id(holder: str | None) -> str | None:
    decoded = holders.decode_holder(holder)
    return None if decoded is None else decoded.run_id


def _tag_dead_holder_run(instance: dg.DagsterInstance, row: waiting.Row, reason: str) -> None:
    """A SIGKILLed run cannot record its own end: the run that took its lease says ``lost`` for it.

    It logs, in the dead run's event log, a step record for each of the dead run's leased steps that never
    recorded an end (still ``pending``), saying ``lost`` (with the attempt, holder and reason; outbox
    unknown: whether its fenced transaction committed is not known), and settles that run's tags from
    them, as the run itself would have.
    """
    run_id = _winner_run_id(row.holder)
    if run_id is None:
        return
    run = instance.get_run_by_id(run_id)
    if run is None:
        return
    unfinished = {
        step_key: record
        for step_key, record in step_records(instance, run_id).items()
        if record.get(metadata.META_OUTCOME) == metadata.PENDING
    } or {"": {}}
    for step_key, record in unfinished.items():
        outcomes = record.get(metadata.META_OUTCOMES)
        keys = sum(int(n) for n in outcomes.values()) if isinstance(outcomes, dict) else 1
        instance.report_engine_event(
            f"{metadata.STEP_EVENT_MESSAGE}: lost: {metadata.bound_tag_text(reason)}",
            run,
            EngineEventData(
                metadata={
                    metadata.META_OUTCOME: dg.MetadataValue.text(metadata.LOST),
                    metadata.META_OUTCOMES: dg.MetadataValue.json({metadata.LOST: keys}),
                    metadata.META_WINNER: dg.MetadataValue.text(metadata.NONE),
                    metadata.META_ATTEMPT: dg.MetadataValue.int(row.attempt),
                    metadata.META_HOLDER: dg.MetadataValue.text(row.holder or metadata.NONE),
                    metadata.META_ERROR: dg.MetadataValue.text(metadata.bound_tag_text(reason)),
                    metadata.META_OUTBOX: dg.MetadataValue.text(metadata.OUTBOX_UNKNOWN),
                    metadata.META_OP: dg.MetadataValue.text(str(record.get(metadata.META_OP, step_key))),
                }
            ),
            step_key=step_key or None,
        )
    settle_run_tags(instance, run_id)


class _DagsterWatcher:
    """What the wait engine asks Dagster: is a holder's run finished, where to say a dead run was taken
    over (its own event log and tags), and the step's log."""

    def __init__(self, context: dg.OpExecutionContext) -> None:
        self.context = context
        self.log: waiting.Log = context.log

    def dead_because(self, holder: str | None) -> str | None:
        instance = self.context.instance
        if not holders.holder_run_finished(instance, holder):
            return None
        status = holders.holder_run_status(instance, holder)
        return f"its Dagster run is {status.value if status else 'finished'}"

    def took_over(self, job: identity.JobIdentity, row: waiting.Row, reason: str) -> None:
        _tag_dead_holder_run(self.context.instance, row, reason)


def _plain_result(
    job: identity.JobIdentity, outcome: str, *, holder: str | None = None, error: str | None = None
) -> metadata.LeasedResult:
    return metadata.LeasedResult(
        code=job.code,
        partition_key=job.run_key,
        idempotency_key=job.idempotency_key,
        outcome=outcome,
        attempt=None,
        outbox=metadata.OUTBOX_NOT_ENQUEUED,
        holder=holder,
        error=error,
    )


def _leased_result(
    step: _Step, key: waiting.KeyOutcome, outbox_flags: Sequence[bool]
) -> metadata.LeasedResult:
    """The engine's outcome of one key as the step records it (with its outbox result and winner run)."""
    job = key.job
    if key.outcome in (waiting.WaitOutcome.WON, waiting.WaitOutcome.RECLAIMED):
        winner = step.run_id
    elif key.outcome is waiting.WaitOutcome.SKIPPED_SUCCEEDED:
        winner = _winner_run_id(key.holder)
    else:
        winner = None
    return metadata.LeasedResult(
        code=job.code,
        partition_key=job.run_key,
        idempotency_key=job.idempotency_key,
        outcome=key.outcome.value,
        attempt=key.attempt,
        outbox=metadata.outbox_label(outbox_flags),
        result=key.result,
        holder=key.holder,
        winner_run_id=winner,
        error=key.error,
    )


@dataclasses.dataclass
class _Settled:
    """Every key of a step with its result, in key order, and why the step stopped early (if it did)."""

    results: list[metadata.LeasedResult]
    #: the first exception a key raised (the body's, or the database's): the step failure's cause
    error: BaseException | None = None
    #: Dagster's run termination (or another interrupt): re-raised once what was done is recorded
    interrupt: BaseException | None = None

    @property
    def not_done(self) -> list[metadata.LeasedResult]:
        return [r for r in self.results if not r.done]


def _settle_per_key(step: _Step, jobs: Sequence[identity.JobIdentity]) -> _Settled:
    """Per-key mode (and a single partition): the engine calls the body once per key won."""
    runs: dict[str, LeasedRun] = {}

    def body(held: lease.Lease) -> Any:
        run_key = held.identity.run_key
        run = runs[held.idempotency_key] = LeasedRun(
            _key_context(step, run_key), step.resource, held, run_key
        )
        return step.fn(run)

    report = waiting.settle_each(step.wait, jobs, body)
    # A key's outbox result is what its body's committed transactions enqueued, whatever the key came to:
    # a key lost after its commit has its row (it will be delivered).
    results = [
        _leased_result(
            step, key, runs[key.job.idempotency_key].enqueued if key.job.idempotency_key in runs else []
        )
        for key in report.outcomes
    ]
    return _Settled(results, report.error, report.interrupt)


class LeasedBatch:
    """What a batch-mode body gets: the keys this call won, their leases, and one fenced transaction.

    ``partition_keys`` are the keys of this call (in the range's order), each won by this run (a first
    claim or a reclaim); the body does them all at once, e.g. one SQL statement over the range, then one
    outbox row per key with :meth:`enqueue_many`, inside :meth:`transaction`. The same step may call the
    body again with keys it won later (keys another holder had when the range started, freed during the
    bounded wait); each call has its own set and its own transaction.
    """

    def __init__(
        self,
        context: dg.OpExecutionContext,
        resource: JobLeaseResource,
        service: lease.LeaseService,
        leases: Sequence[lease.Lease],
    ) -> None:
        self.context = context
        self.resource = resource
        self.service = service
        self.leases = tuple(leases)
        self.partition_keys: list[str | None] = [x.identity.run_key for x in self.leases]
        #: per idempotency key, what ``enqueue_many`` returned, for rows that are written (as
        #: :attr:`LeasedRun.enqueued`: a refused or rolled-back transaction adds none)
        self.enqueued: dict[str, bool] = {}
        self._uncommitted: dict[str, bool] | None = None

    @property
    def idempotency_keys(self) -> dict[str | None, str]:
        """Each partition key's idempotency key (the outbox row's key by default)."""
        return {x.identity.run_key: x.idempotency_key for x in self.leases}

    @property
    def log(self) -> Any:
        return self.context.log

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sa.Connection]:
        """One transaction for the whole set, committed only while every lease of the set is this run's.

        If any lease of the set was lost, nothing of the block runs or commits, every lease of the set is
        failed for a retry and :class:`~dagster_joblease.errors.LostBatchLeaseError` names the key.
        """
        pending: dict[str, bool] = {}
        self._uncommitted = pending
        try:
            with batch_leases.fenced_transaction_many(self.service, self.leases) as connection:
                yield connection
        finally:
            self._uncommitted = None
        self.enqueued.update(pending)

    def enqueue_many(
        self,
        connection: sa.Connection,
        *,
        topic: str,
        payloads: Mapping[str | None, Any],
        ordering_key: str | None = None,
    ) -> tuple[bool, ...]:
        """One outbox row per partition key of ``payloads`` (keyed by that key's idempotency key), in one
        multi-row statement; True per row if inserted, False if it was already there. ``ordering_key``:
        every row under it, delivered one at a time in the mapping's order after the key's earlier rows
        (see :func:`dagster_joblease.outbox.enqueue_many`)."""
        keys = self.idempotency_keys
        unknown = [k for k in payloads if k not in keys]
        if unknown:
            raise errors.ConfigurationError(
                f"enqueue_many got partition keys {unknown[:5]!r} that are not this call's keys "
                f"({len(keys)} keys: {self.partition_keys[:5]!r}…); give a payload per key of "
                "run.partition_keys"
            )
        items = [outbox.OutboxItem(keys[k], topic, payload, ordering_key) for k, payload in payloads.items()]
        inserted = outbox.enqueue_many(connection, items)
        written = self.enqueued if self._uncommitted is None else self._uncommitted
        for item, was_inserted in zip(items, inserted, strict=True):
            written[item.idempotency_key] = was_inserted
        return inserted


def _settle_batch(step: _Step, jobs: Sequence[identity.JobIdentity]) -> _Settled:
    """Batch mode: the engine calls the body with each set of keys won (see the module docstring)."""
    enqueued: dict[str, bool] = {}

    def body(won: Sequence[lease.Lease]) -> Any:
        run = LeasedBatch(step.context, step.resource, step.wait.service, won)
        try:
            value = step.fn(run)  # type: ignore[arg-type]
        except errors.LostLeaseError:  # the set's fenced transaction was refused: nothing was written
            raise
        except BaseException:
            enqueued.update(run.enqueued)
            raise
        enqueued.update(run.enqueued)
        return value

    report = waiting.settle_batch(step.wait, jobs, body)
    results = [
        _leased_result(
            step, key, [enqueued[key.job.idempotency_key]] if key.job.idempotency_key in enqueued else []
        )
        for key in report.outcomes
    ]
    return _Settled(results, report.error, report.interrupt)


def _step_for(
    context: AnyContext,
    resource: JobLeaseResource,
    code: str,
    fn: Callable[[LeasedRun], Any],
    lease_ms: int | None,
    heartbeat_ms: int | None,
    held_wait_ms: int | None,
    max_failures_in_a_row: int,
) -> _Step:
    op_context = _op_context(context)
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
    wait = waiting.Wait(
        service,
        timing,
        wait_ms,
        taker=f"run {run_id or holder}",
        watcher=_DagsterWatcher(op_context),
        max_failures_in_a_row=max_failures_in_a_row,
    )
    return _Step(
        op_context,
        resource,
        fn,
        run_id,
        wait,
        ranged=_is_range(op_context),
        partitions_def=_partitions_def(context),
    )


def _log_results(step: _Step, results: Sequence[metadata.LeasedResult]) -> None:
    log = step.context.log
    for r in results[:_LOG_KEYS]:
        note = metadata.skip_note(r)  # a skip says so first: "skipped: done by run X; ..."
        log.info(
            (f"{note}; " if note else "")
            + f"joblease {r.code}/{r.partition_key or '(initial)'}: {r.outcome} (attempt {r.attempt}, outbox "
            f"{r.outbox}, holder {r.holder}, key {r.idempotency_key})"
        )
    _warn_absent_winners(step, results[:_LOG_KEYS])
    if len(results) > _LOG_KEYS:
        log.info(
            f"joblease: {len(results)} keys: {metadata.format_counts(metadata.outcome_counts(results))} "
            f"(the first {_LOG_KEYS} are logged above; every key is in the step's metadata)"
        )


def _warn_absent_winners(step: _Step, results: Sequence[metadata.LeasedResult]) -> None:
    """A skip naming a run this instance does not have says so (once per such run)."""
    if step.run_id is None:
        return  # an ephemeral context: no instance to look the winner up in
    seen: set[str] = set()
    for r in results:
        winner = r.winner_run_id
        if not r.skipped or winner is None or winner in seen:
            continue
        seen.add(winner)
        if step.context.instance.get_run_by_id(winner) is None:
            step.context.log.warning(step.resource.absent_winner_note(winner, r.code, r.partition_key))


def _settle(
    context: AnyContext,
    resource: JobLeaseResource,
    code: str,
    fn: Callable[[LeasedRun], Any],
    initial: bool,
    lease_ms: int | None,
    heartbeat_ms: int | None,
    held_wait_ms: int | None,
    max_failures_in_a_row: int,
    batch: bool = False,
) -> _Settled:
    """Settle every key of this step and record it (the step's engine event, the run's tags)."""
    op_context = _op_context(context)
    keys = _partition_keys(op_context, code, initial)
    _check_partition_keys(context, code, keys)
    jobs = [
        identity.JobIdentity.initial(code) if k is None else identity.JobIdentity.schedule(code, k)
        for k in keys
    ]
    step = _step_for(context, resource, code, fn, lease_ms, heartbeat_ms, held_wait_ms, max_failures_in_a_row)
    settled = _Settled([_plain_result(job, metadata.PENDING) for job in jobs])
    if _report_step(op_context, settled.results) is not None:
        settle_run_tags(op_context.instance, op_context.run_id)
        _warn_if_uncovered(op_context)
    try:
        settled = _settle_batch(step, jobs) if batch else _settle_per_key(step, jobs)
    finally:
        # Whatever happened (even an error of our own), the step says what each key came to.
        _log_results(step, settled.results)
        if _report_step(op_context, settled.results) is not None:
            settle_run_tags(op_context.instance, op_context.run_id)
    return settled


def _warn_if_uncovered(context: dg.OpExecutionContext) -> None:
    """Say in the step's log when this code location has no not-run sensors (see not_run_coverage)."""
    try:
        repository: dg.RepositoryDefinition | None = context.repository_def
    except Exception:  # a step run outside a code location has none
        repository = None
    note = not_run_coverage.uncovered_note(repository)
    if note is not None:
        context.log.warning(note)


def _not_done_failure(settled: _Settled, step_metadata: Mapping[str, Any]) -> dg.Failure:
    """The step's failure: which keys are not done and why (retryable: a retry or relaunch redoes them)."""
    not_done = settled.not_done
    by_outcome: dict[str, list[metadata.LeasedResult]] = {}
    for r in not_done:
        by_outcome.setdefault(r.outcome, []).append(r)
    parts = []
    for outcome in metadata.OUTCOMES:
        group = by_outcome.get(outcome)
        if not group:
            continue
        shown = [
            f"{r.partition_key or '(initial)'}" + (f" ({r.error})" if r.error and i < 3 else "")
            for i, r in enumerate(group[:10])
        ]
        more = f" and {len(group) - 10} more" if len(group) > 10 else ""
        parts.append(f"{outcome}: " + ", ".join(shown) + more)
    total = len(settled.results)
    head = (
        f"{len(not_done)} of {total} keys not done"
        if total > 1
        else f"partition {not_done[0].partition_key or '(initial)'} not done"
    )
    return dg.Failure(
        description=f"{head}: " + "; ".join(parts) + ". The run did not claim success: it can be retried "
        "(Dagster run retries, a re-execution, or the reconciliation sensor).",
        metadata=dict(step_metadata),
        allow_retries=True,
    )


def _raise_not_done(settled: _Settled, step_metadata: Mapping[str, Any]) -> None:
    if settled.interrupt is not None:
        raise settled.interrupt
    if not settled.not_done:
        return
    failure = _not_done_failure(settled, step_metadata)
    if settled.error is not None:
        raise failure from settled.error
    raise failure


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
    max_failures_in_a_row: int = DEFAULT_MAX_FAILURES_IN_A_ROW,
    batch: bool = False,
) -> list[metadata.LeasedResult]:
    """Run ``fn`` once per partition key of this run (one lease per key), or once for an INITIAL job.

    Returns one :class:`LeasedResult` per key when every key is done, and tags the run with the outcome
    (``pending`` first, so tags copied from a parent run never stand). A key that already succeeded is a
    recorded skip. A key held by a live lease is waited for (``held_wait_ms``, default the resource's,
    5 minutes). ``fn``'s exception fails that key's lease (the next run or retry takes over with the same
    idempotency key); a range goes on with its other keys unless ``max_failures_in_a_row`` keys fail one
    after the other. If any key is not done, :class:`dagster.Failure` (retryable) names them, with the
    body's first exception as its cause; the step's metadata has every key's outcome.

    ``batch=True``: ``fn`` gets a :class:`LeasedBatch` (the keys this run won, at once) instead; see
    the module docstring.
    """
    checks.integer("max_failures_in_a_row", max_failures_in_a_row, minimum=1, why=_MAX_FAILURES_WHY)
    settled = _settle(
        context,
        resource,
        code,
        fn,
        initial,
        lease_ms,
        heartbeat_ms,
        held_wait_ms,
        max_failures_in_a_row,
        batch,
    )
    _raise_not_done(settled, metadata.step_metadata(settled.results))
    return settled.results


#: Why ``max_failures_in_a_row`` exists, said when it is refused.
_MAX_FAILURES_WHY = (
    "how many keys of a range may fail one after the other before the rest are not attempted; "
    f"default {DEFAULT_MAX_FAILURES_IN_A_ROW}"
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
    max_failures_in_a_row: int = DEFAULT_MAX_FAILURES_IN_A_ROW,
    batch: bool = False,
    **op_kwargs: Any,
) -> Callable[[Callable[[Any], Any]], dg.OpDefinition]:
    """Decorate ``fn(run: LeasedRun)`` into an op that runs it under the lease for each partition key.

    The op's output is the list of :class:`LeasedResult` (with output metadata: outcome, winner run,
    idempotency key, attempt, holder, outbox result; per key for a range). ``initial=True`` makes it a
    run-once (``INITIAL``) op instead. ``held_wait_ms`` bounds the wait for a live holder (default: the
    resource's, 5 minutes). When some key is not done the op fails (retryable) naming those keys, and
    produces no output.

    Args:
        code: The lease code: with each partition key (the run key) it names one logical run.
        name: The op's name (default: the function's).
        initial: A run-once (``INITIAL``) op: one lease for ``code``, whatever the partition.
        resource_key: The key of the ``JobLeaseResource`` the op uses (default ``joblease``).
        lease_ms: Lease length in ms for this step (default: the resource's, 3 minutes).
        heartbeat_ms: Renewal interval in ms (default: the resource's; 0: none).
        held_wait_ms: How long a key found held by a live lease waits for its holder before it ends
            ``held`` (default: the resource's, 5 minutes).
        max_failures_in_a_row: In a range run, keys that may fail one after the other before the rest
            are not attempted (default 3).
        batch: Call the body once with a ``LeasedBatch`` of the keys this run won (claimed with one
            statement) instead of once per key.
        **op_kwargs: Passed to ``dagster.op`` (``tags`` are merged with the op's own).

    Example::

        @leased_op(code="daily-billing")
        def bill(run: LeasedRun) -> None:
            with run.transaction() as conn:
                conn.execute(invoices.insert().values(day=run.partition_key))
                run.enqueue_once(conn, topic="billing.daily", payload={"billingDate": run.partition_key})
    """
    identity.JobIdentity.initial(code)  # validate the code and the options at definition time
    if held_wait_ms is not None:
        check_held_wait_ms(held_wait_ms)
    checks.integer("max_failures_in_a_row", max_failures_in_a_row, minimum=1, why=_MAX_FAILURES_WHY)
    tags = {metadata.TAG_CODE: code, **op_kwargs.pop("tags", {})}

    def decorate(fn: Callable[[Any], Any]) -> dg.OpDefinition:
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
                max_failures_in_a_row=max_failures_in_a_row,
                batch=batch,
            )
            return dg.Output(results, metadata=metadata.step_metadata(results))

        op_def: dg.OpDefinition = dg.op(
            name=name or fn.__name__,
            description=fn.__doc__,
            required_resource_keys={resource_key},
            tags=tags,
            **op_kwargs,
        )(real_annotations(_leased, dg.Output[list[metadata.LeasedResult]], context=OpExecutionContext))
        return op_def

    return decorate


def _already_materialized(
    context: AssetExecutionContext, results: Sequence[metadata.LeasedResult]
) -> set[str | None]:
    """The skipped keys this instance already has a materialization for (``None``: the INITIAL run's
    unpartitioned asset): one query for the whole range."""
    skipped = {r.partition_key for r in results if r.skipped}
    if not skipped:
        return set()
    if context.assets_def.partitions_def is None:  # an unpartitioned (INITIAL) asset
        has_one = context.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=context.asset_key), limit=1
        ).records
        return skipped if has_one else set()
    materialized: set[str] = context.instance.get_materialized_partitions(context.asset_key)
    return skipped & set(materialized)


def _downstream_in_run(context: AssetExecutionContext) -> bool:
    """Does this run also execute an asset that depends on this one? (When unsure: yes.)"""
    try:
        graph = context.job_def.asset_layer.asset_graph
        children = graph.get(context.asset_key).child_keys
        selection = context.op_execution_context.run.asset_selection
        # An empty or absent selection (dg.materialize, a whole asset job) means every asset of the job.
        in_run = set(selection) if selection else set(graph.get_all_asset_keys())
    except Exception:
        return True
    return bool(set(children) & in_run)


def _in_asset_backfill(context: AssetExecutionContext) -> bool:
    """Is this run one of an *asset* backfill's (Dagster's ``dagster/backfill`` tag, a backfill of assets)?

    Its daemon counts a partition done only by a materialization one of its runs recorded. A job backfill
    is judged by its runs' statuses instead. When the backfill cannot be read: yes (a skip materialized
    once more is harmless; a backfill that never sees its partition done is not).
    """
    run = _stored_run(context.op_execution_context)
    backfill_id = None if run is None else run.tags.get(BACKFILL_TAG)
    if not backfill_id:
        return False
    try:
        backfill = context.instance.get_backfill(backfill_id)
    except Exception:
        return True
    return backfill is None or bool(getattr(backfill, "is_asset_backfill", True))


@dataclasses.dataclass(frozen=True)
class AssetRecording:
    """What a leased asset step records for its keys, besides the step's engine event and tags."""

    #: yield the asset's output: Dagster materializes every key of the run (downstream steps go ahead)
    output: bool
    #: with no output: the keys materialized one by one (each its own metadata)
    materialized: tuple[str | None, ...]
    #: the skipped keys, each an asset observation (``skipped: done by run X``)
    observed: tuple[str | None, ...]


def asset_recording(
    results: Sequence[metadata.LeasedResult],
    *,
    all_done: bool,
    materialized_here: AbstractSet[str | None],
    downstream_in_run: bool,
    asset_backfill: bool,
) -> AssetRecording:
    """How a leased asset records its keys: the one rule for a skip (pure).

    Every skipped key is observed (labels of its own, so the win stays what the partition page shows). A
    skipped key is also materialized only where Dagster needs a materialization: in an asset backfill's
    run (the backfill daemon counts a partition done only by a materialization of one of its runs; without
    it the backfill ends Failed), where this instance has none for the key (the winner ran elsewhere), or
    when a downstream step of the run needs the output. Anywhere else a skip adds no materialization, so
    it triggers nothing downstream (automation reads materializations of a materialized asset).

    ``all_done``: every key is done and the step was not interrupted: the output is yielded when any key
    needs a materialization or a downstream step needs it, and it materializes every key of the run (a
    range cannot materialize some of its keys through its output). Otherwise there is no output: each key
    this run did is materialized, and each skip that needs one.
    """
    skipped = tuple(r.partition_key for r in results if r.skipped)
    needs = {k for k in skipped if asset_backfill or k not in materialized_here}
    if all_done:
        output = downstream_in_run or bool(needs) or any(r.acquired for r in results)
        return AssetRecording(output=output, materialized=(), observed=skipped)
    keys = tuple(r.partition_key for r in results if r.acquired or (r.skipped and r.partition_key in needs))
    return AssetRecording(output=False, materialized=keys, observed=skipped)


def _asset_events(
    context: AssetExecutionContext, settled: _Settled
) -> Iterator[dg.MaterializeResult[Any] | dg.AssetMaterialization | dg.AssetObservation]:
    """What the asset step yields (:func:`asset_recording` decides): first an observation per skipped key,
    then the output or one materialization per key that needs one."""
    results = settled.results
    recording = asset_recording(
        results,
        all_done=not settled.not_done and settled.interrupt is None,
        materialized_here=_already_materialized(context, results),
        downstream_in_run=_downstream_in_run(context),
        asset_backfill=_in_asset_backfill(context),
    )
    # A skip is observed first ("skipped: done by run X"), whatever is materialized after it.
    yield from metadata.skip_observations(context.asset_key, results)
    if recording.output:
        yield dg.MaterializeResult(metadata=metadata.materialization_metadata(results))
        return
    wanted = set(recording.materialized)
    for r in results:
        if r.partition_key in wanted:
            yield dg.AssetMaterialization(
                asset_key=context.asset_key,
                partition=r.partition_key,
                description=metadata.skip_note(r),
                metadata=metadata.materialization_metadata([r]),
            )


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
    max_failures_in_a_row: int = DEFAULT_MAX_FAILURES_IN_A_ROW,
    batch: bool = False,
    **asset_kwargs: Any,
) -> Callable[[Callable[[Any], Any]], dg.AssetsDefinition]:
    """Decorate ``fn(run: LeasedRun)`` into an asset that takes one lease per partition key.

    When every key of the run is done (by this run, or already by another), the asset's output is produced
    (Dagster records a materialization for every key, and downstream assets of the run go ahead for the
    whole range) unless no key needs one: a run whose keys were all skips, each already materialized on
    this instance, outside an asset backfill and with nothing downstream in the run, records nothing new
    (so automation sees nothing new). When some key is not done, there is no output (downstream steps do
    not run): a materialization is recorded for each key this run did (and each skip that needs one), and
    the step fails naming the keys not done. ``held`` and failed keys materialize nothing.

    A skipped key is recorded as an asset observation (first, before any materialization) whose
    description says ``skipped: done by run X``, and as a materialization only in an asset backfill's
    run, where this instance has none for the key, or for a downstream step of the run: the one rule is
    :func:`asset_recording` (docs/dagster.md, "How a skip is recorded").

    With ``backfill_policy=BackfillPolicy.single_run()`` a backfill is one run over a partition range;
    each key in it is still its own logical run (its own lease and idempotency key).

    Args:
        code: The lease code: with each partition key (the run key) it names one logical run.
        partitions_def: The asset's partitions; each key is one logical run.
        name: The asset's name (default: the function's).
        initial: A run-once (``INITIAL``) asset: one lease for ``code``.
        resource_key: The key of the ``JobLeaseResource`` the asset uses (default ``joblease``).
        backfill_policy: Dagster's; ``BackfillPolicy.single_run()`` makes a backfill one range run.
        lease_ms: Lease length in ms for this step (default: the resource's, 3 minutes).
        heartbeat_ms: Renewal interval in ms (default: the resource's; 0: none).
        held_wait_ms: How long a key found held by a live lease waits for its holder before it ends
            ``held`` (default: the resource's, 5 minutes).
        max_failures_in_a_row: In a range run, keys that may fail one after the other before the rest
            are not attempted (default 3).
        batch: Call the body once with a ``LeasedBatch`` of the keys this run won (claimed with one
            statement) instead of once per key.
        **asset_kwargs: Passed to ``dagster.asset`` (``op_tags`` are merged with the asset's own).

    Example::

        @leased_asset(code="daily-report", partitions_def=dg.DailyPartitionsDefinition("2024-01-01"))
        def daily_report(run: LeasedRun) -> None:
            with run.transaction() as conn:
                run.enqueue_once(conn, topic="reports.daily", payload={"day": run.partition_key})
    """
    identity.JobIdentity.initial(code)
    if held_wait_ms is not None:
        check_held_wait_ms(held_wait_ms)
    checks.integer("max_failures_in_a_row", max_failures_in_a_row, minimum=1, why=_MAX_FAILURES_WHY)
    op_tags = {metadata.TAG_CODE: code, **asset_kwargs.pop("op_tags", {})}

    def decorate(fn: Callable[[Any], Any]) -> dg.AssetsDefinition:
        def _leased(
            context: AssetExecutionContext,
        ) -> Iterator[dg.MaterializeResult[Any] | dg.AssetMaterialization | dg.AssetObservation]:
            settled = _settle(
                context,
                getattr(context.resources, resource_key),
                code,
                fn,
                initial,
                lease_ms,
                heartbeat_ms,
                held_wait_ms,
                max_failures_in_a_row,
                batch,
            )
            # Yielded, not logged: events logged with log_event are flushed only when the step yields or
            # ends, and a raise right after would drop them.
            yield from _asset_events(context, settled)
            _raise_not_done(settled, metadata.step_metadata(settled.results))

        asset_def: dg.AssetsDefinition = dg.asset(
            name=name or fn.__name__,
            description=fn.__doc__,
            partitions_def=partitions_def,
            backfill_policy=backfill_policy,
            required_resource_keys={resource_key},
            op_tags=op_tags,
            output_required=False,
            **asset_kwargs,
        )(
            real_annotations(
                _leased,
                Iterator[dg.MaterializeResult[Any] | dg.AssetMaterialization | dg.AssetObservation],
                context=AssetExecutionContext,
            )
        )
        return asset_def

    return decorate
