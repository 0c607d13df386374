"""For users' own Dagster tests: run one partition of a leased job twice at once, as an overlapping
backfill and schedule tick would, and see what each run recorded."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import dagster as dg

from dagster_joblease import checks, errors
from dagster_joblease.dagster import metadata, ops

__all__ = ["PartitionRun", "run_partition_twice"]

DEFAULT_TIMEOUT_S = 300.0
_JOBLEASE_TAG_PREFIX = "joblease/"


@dataclasses.dataclass(frozen=True)
class PartitionRun:
    """One of the runs :func:`run_partition_twice` launched.

    ``outcome`` is the run's ``joblease/outcome`` tag (compare it with the constants in
    :mod:`dagster_joblease.dagster.metadata`; ``None`` if no leased op recorded one), ``tags`` all its
    ``joblease/...`` tags, ``error`` the failure messages of a failed run, ``steps`` each leased step's
    record by step key (its metadata as plain values: ``joblease/outbox``, ``joblease/attempt``,
    ``joblease/error`` …, see :func:`dagster_joblease.dagster.ops.step_records`).
    """

    launched_as: str  #: "backfill" or "schedule"
    run_id: str
    success: bool
    outcome: str | None
    tags: Mapping[str, str]
    error: str | None = None
    steps: Mapping[str, Mapping[str, object]] = dataclasses.field(default_factory=dict)

    @property
    def record(self) -> Mapping[str, object]:
        """The record of the run's leased step (the first one's if the job has several; empty if none)."""
        return next(iter(self.steps.values()), {})

    @property
    def won(self) -> bool:
        """This run ran the body (it won or reclaimed the lease)."""
        return self.outcome in (metadata.WON, metadata.RECLAIMED)


def _failure_text(event: dg.DagsterEvent) -> str:
    """A failed step's error and its causes (the body's own exception is the cause of Dagster's)."""
    parts = [f"step {event.step_key!r} failed"]
    error = event.step_failure_data.error
    while error is not None:
        parts.append(error.message.strip().rstrip(":"))
        error = error.cause
    return ": ".join(parts)


def _launch_tags(job: dg.JobDefinition, partition_key: str) -> list[tuple[str, dict[str, str]]]:
    return [
        ("backfill", {"dagster/backfill": f"joblease-test-{uuid.uuid4().hex[:8]}"}),
        ("schedule", {"dagster/schedule_name": f"{job.name}_schedule", "dagster/run_key": partition_key}),
    ]


def run_partition_twice(
    job: dg.JobDefinition,
    partition_key: str,
    *,
    resources: Mapping[str, Any] | None = None,
    run_config: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[PartitionRun, PartitionRun]:
    """Execute ``job`` for ``partition_key`` twice at the same moment, in-process, and return both runs.

    One run is tagged as a backfill's, the other as a schedule tick's; Dagster dedupes neither against
    the other, so only the lease decides. Expect exactly one ``won`` run and one skip, both successful,
    and one effect.

    The runs execute on two threads released together, each on its own ephemeral
    ``DagsterInstance`` (in-memory storage, no compute-log capture): a shared instance would capture
    both runs' stdout by swapping the process's file descriptors, which is not thread-safe. Pass the
    joblease resource pointing at your test database in ``resources``, e.g.
    ``{"joblease": JobLeaseResource(database_url=url)}``; it overrides the job's own.

    Example::

        first, second = run_partition_twice(
            daily_billing_job, "2024-01-01", resources={"joblease": JobLeaseResource(database_url=url)}
        )
        assert [first.won, second.won].count(True) == 1

    Raises:
        ConfigurationError: an argument is invalid (before any run starts).
        Exception: whatever ``execute_in_process`` raised before a run could start (bad config).
    """
    _check_twice(job, partition_key, timeout_s)
    launches = _launch_tags(job, partition_key)
    launcher = _Launcher(
        job, partition_key, resources, run_config, timeout_s, barrier=threading.Barrier(len(launches))
    )
    threads = [
        threading.Thread(
            target=launcher.launch, args=(label, tags), name=f"joblease-test-{label}", daemon=True
        )
        for label, tags in launches
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if any(thread.is_alive() for thread in threads):
        raise AssertionError(f"the runs of {job.name} for {partition_key!r} did not finish in {timeout_s} s")
    cause = first_cause(launcher.raised.values())
    if cause is not None:
        raise cause
    return launcher.runs["backfill"], launcher.runs["schedule"]


def _check_twice(job: object, partition_key: object, timeout_s: object) -> None:
    if not isinstance(job, dg.JobDefinition):
        raise errors.ConfigurationError(
            f"job must be a dagster JobDefinition (a @job), got {type(job).__name__}"
        )
    if not isinstance(partition_key, str) or not partition_key.strip():
        raise errors.ConfigurationError(f"partition_key={partition_key!r} must be a non-blank str")
    checks.number("timeout_s", timeout_s, above=0)


def first_cause(raised: Iterable[BaseException]) -> BaseException | None:
    """What a launch raised that the caller should see: the first error that is not a broken barrier
    (a launch that failed breaks the barrier for the other), else the first error, else None."""
    errors_seen = list(raised)
    for exc in errors_seen:
        if not isinstance(exc, threading.BrokenBarrierError):
            return exc
    return errors_seen[0] if errors_seen else None


@dataclasses.dataclass
class _Launcher:
    """Runs one launch of the job per thread, each on its own ephemeral instance, released together by
    ``barrier``; keeps each launch's :class:`PartitionRun` (``runs``) or what it raised (``raised``)."""

    job: dg.JobDefinition
    partition_key: str
    resources: Mapping[str, Any] | None
    run_config: Mapping[str, Any] | None
    timeout_s: float
    barrier: threading.Barrier
    runs: dict[str, PartitionRun] = dataclasses.field(default_factory=dict)
    raised: dict[str, BaseException] = dataclasses.field(default_factory=dict)

    def launch(self, label: str, tags: dict[str, str]) -> None:
        try:
            with dg.DagsterInstance.ephemeral() as instance:
                self.barrier.wait(self.timeout_s)
                result = self.job.execute_in_process(
                    partition_key=self.partition_key,
                    instance=instance,
                    tags=tags,
                    run_config=self.run_config,
                    resources=self.resources,
                    raise_on_error=False,
                )
                self.runs[label] = _partition_run(label, result, instance)
        except BaseException as exc:
            self.raised[label] = exc
            self.barrier.abort()


def _partition_run(
    label: str, result: dg.ExecuteInProcessResult, instance: dg.DagsterInstance
) -> PartitionRun:
    stored = instance.get_run_by_id(result.run_id)
    run_tags = dict(stored.tags) if stored is not None else {}
    failures = [_failure_text(e) for e in result.all_events if e.is_step_failure]
    return PartitionRun(
        launched_as=label,
        run_id=result.run_id,
        success=result.success,
        outcome=run_tags.get(metadata.TAG_OUTCOME),
        tags={k: v for k, v in run_tags.items() if k.startswith(_JOBLEASE_TAG_PREFIX)},
        error=None if result.success else "; ".join(failures) or "the run failed",
        steps=ops.step_records(instance, result.run_id),
    )
