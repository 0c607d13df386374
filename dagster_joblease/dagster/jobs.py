"""The dispatcher job, the ``joblease_outbox`` asset it observes and the dead-row asset check.

The outbox table is not materialised by Dagster; it appears in the catalog as an external
``AssetSpec("joblease_outbox")``. Each dispatcher run logs an observation with its counts and an
evaluation of the ``no_dead_rows`` check, which fails (severity ERROR: a dead row is an effect that will
not happen unless someone requeues it) and names the dead rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg
import sqlalchemy as sa
from dagster import AssetCheckExecutionContext, OpExecutionContext

from dagster_joblease import dispatch, outbox
from dagster_joblease.dagster.ops import real_annotations
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.schema import outbox_table

__all__ = [
    "DEAD_ROWS_CHECK",
    "OUTBOX_ASSET_KEY",
    "DispatchConfig",
    "build_dead_rows_check",
    "build_dispatcher_job",
    "dead_rows_evaluation",
    "outbox_asset_spec",
]

OUTBOX_ASSET_KEY = dg.AssetKey("joblease_outbox")
DEAD_ROWS_CHECK = "no_dead_rows"
DEAD_ROWS_SHOWN = 20
DEAD_ROWS_SEVERITY = dg.AssetCheckSeverity.ERROR

outbox_asset_spec = dg.AssetSpec(
    OUTBOX_ASSET_KEY,
    description=(
        "The joblease transactional outbox: one row per effect (idempotency key), delivered by the "
        "dispatcher job. Dead rows need a human: fix the cause, then `joblease outbox requeue`."
    ),
    group_name="joblease",
)

_DispatchOutput = dg.Output[dict[str, int]]
RoutesSource = Mapping[str, "dispatch.Route"] | Callable[[], Mapping[str, "dispatch.Route"]]


class DispatchConfig(dg.Config):
    """How much one dispatcher run may do before it ends (a bound, so a run never loops forever)."""

    max_batches: int = 50
    batch_size: int = 100


def _cell(value: object) -> str:
    return str(value if value is not None else "").replace("|", "\\|").replace("\n", " ")[:200]


def dead_rows_evaluation(engine: sa.Engine, *, limit: int = DEAD_ROWS_SHOWN) -> dg.AssetCheckEvaluation:
    """The ``no_dead_rows`` check: passes when no row is DEAD, else names them (id, key, topic, error)."""
    t = outbox_table
    dead = t.c.status == outbox.OutboxStatus.DEAD.value
    with translate_errors("list dead outbox rows"), engine.connect() as connection:
        count = int(connection.execute(sa.select(sa.func.count()).select_from(t).where(dead)).scalar_one())
        rows = connection.execute(
            sa.select(t.c.id, t.c.idempotency_key, t.c.topic, t.c.attempts, t.c.last_status, t.c.last_error)
            .where(dead)
            .order_by(t.c.id)
            .limit(limit)
        ).all()
    lines = [
        "| id | idempotency key | topic | attempts | last status | last error |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.id} | `{r.idempotency_key}` | {_cell(r.topic)} | {r.attempts} | {_cell(r.last_status)} | "
        f"{_cell(r.last_error)} |"
        for r in rows
    ]
    meta: dict[str, Any] = {"dead_rows": dg.MetadataValue.int(count)}
    if rows:
        meta["dead"] = dg.MetadataValue.md("\n".join(lines))
        meta["dead_ids"] = dg.MetadataValue.text(", ".join(str(r.id) for r in rows))
    description = (
        "no dead outbox rows"
        if count == 0
        else f"{count} dead outbox row(s); the first: id {rows[0].id}, topic {rows[0].topic}, "
        f"last status {rows[0].last_status}, error {_cell(rows[0].last_error)}. Fix the cause, then "
        "requeue them (`joblease outbox requeue --all-dead`)."
    )
    return dg.AssetCheckEvaluation(
        asset_key=OUTBOX_ASSET_KEY,
        check_name=DEAD_ROWS_CHECK,
        passed=count == 0,
        severity=DEAD_ROWS_SEVERITY,
        metadata=meta,
        description=description,
    )


def build_dead_rows_check(*, resource_key: str = "joblease") -> dg.AssetChecksDefinition:
    """The ``no_dead_rows`` asset check on ``joblease_outbox``, runnable on its own from the UI."""

    def _check(context: AssetCheckExecutionContext) -> dg.AssetCheckResult:
        evaluation = dead_rows_evaluation(getattr(context.resources, resource_key).engine)
        return dg.AssetCheckResult(
            passed=evaluation.passed,
            severity=evaluation.severity,
            metadata=evaluation.metadata,
            description=evaluation.description,
        )

    checks: dg.AssetChecksDefinition = dg.asset_check(
        asset=OUTBOX_ASSET_KEY,
        name=DEAD_ROWS_CHECK,
        description="Fails (ERROR) while any outbox row is dead-lettered, and names the rows.",
        required_resource_keys={resource_key},
    )(real_annotations(_check, dg.AssetCheckResult, context=AssetCheckExecutionContext))
    return checks


def build_dispatcher_job(
    routes: RoutesSource,
    *,
    name: str = "outbox_dispatch_job",
    resource_key: str = "joblease",
    max_attempts: int = 10,
    claim_ms: int = 60_000,
    concurrency: int = 8,
    tags: Mapping[str, str] | None = None,
) -> dg.JobDefinition:
    """A job that dispatches due outbox rows until none is claimable (bounded by ``max_batches``).

    ``routes`` maps topics to :class:`Route`; pass a callable to read it (e.g. from the environment)
    when the run starts rather than when the code location loads. Several dispatcher runs at once are
    safe (claims use ``FOR UPDATE SKIP LOCKED``); the sensor simply avoids piling them up.
    """

    def _dispatch(context: OpExecutionContext, config: DispatchConfig) -> dg.Output[dict[str, int]]:
        resource = getattr(context.resources, resource_key)
        route_map = dict(routes() if callable(routes) else routes)
        totals = dispatch.DispatchReport()
        batches = 0
        with dispatch.Dispatcher(
            resource.engine, route_map, max_attempts=max_attempts, claim_ms=claim_ms, concurrency=concurrency
        ) as dispatcher:
            for _ in range(config.max_batches):
                report = dispatcher.dispatch(limit=config.batch_size)
                batches += 1
                totals = totals.merge(dataclasses.replace(report, rows=[]))
                for row in report.rows:
                    if row.outcome != "sent":
                        context.log.warning(
                            f"outbox row {row.id} ({row.topic}): {row.outcome} "
                            f"(status {row.status_code}): {row.reason}"
                        )
                if report.claimed == 0:
                    break
        remaining = outbox.due_summary(resource.engine)
        counts = {"batches": batches} | {
            key: value for key, value in dataclasses.asdict(totals).items() if key != "rows"
        }
        counts["due_after"] = remaining.due
        context.log.info(
            f"dispatched: claimed {totals.claimed}, sent {totals.sent}, retried {totals.retried}, "
            f"dead {totals.dead} in {batches} batch(es); lost claims {totals.lost_claims}, released "
            f"{totals.released}, unrecorded {totals.unrecorded}; {remaining.due} still due"
        )
        meta = {key: dg.MetadataValue.int(value) for key, value in counts.items()}
        context.log_event(dg.AssetObservation(asset_key=OUTBOX_ASSET_KEY, metadata=meta))
        context.log_event(dead_rows_evaluation(resource.engine))  # type: ignore[arg-type]
        return dg.Output(counts, metadata=meta)

    dispatch_op = dg.op(
        name=f"{name}_dispatch",
        required_resource_keys={resource_key},
        description="Claim, deliver and record due outbox rows; report claimed/sent/retried/dead.",
    )(real_annotations(_dispatch, _DispatchOutput, context=OpExecutionContext, config=DispatchConfig))

    @dg.job(
        name=name,
        description="Deliver due joblease outbox rows (requested by the outbox sensor).",
        tags={"joblease/role": "dispatcher", **(tags or {})},
    )
    def _job() -> None:
        dispatch_op()

    return _job
