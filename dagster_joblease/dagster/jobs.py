"""The dispatcher job, the ``joblease_outbox`` asset it observes, and the delivery-health asset checks.

The outbox table is not materialised by Dagster; it appears in the catalog as an external
``AssetSpec("joblease_outbox")``. Three checks tell whether delivery is healthy, each scoped to the topics
this code location routes (several locations with different routes can share one joblease database):

- ``no_dead_rows`` (ERROR): fails while a routed row is DEAD, and names the rows;
- ``delivery_backlog`` (WARN): fails while routed rows are retrying after a failed attempt, or the oldest
  due row has waited longer than ``stale_due_ms``;
- ``no_unrouted_rows`` (WARN): fails while pending rows of a topic this location does *not* route are
  older than ``unrouted_after_ms`` (another location should deliver them; if none does, they are seen).

The dispatcher job reports them after each run; the outbox and reconciliation sensors report them on
their own schedule, so they run even when no dispatcher does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import dagster as dg
import sqlalchemy as sa
from dagster import AssetCheckExecutionContext, OpExecutionContext

from dagster_joblease import checks, delivery_status, dispatch, errors, outbox
from dagster_joblease.dagster.ops import real_annotations
from dagster_joblease.storage import outbox as outbox_store
from dagster_joblease.storage.engine import translate_errors

__all__ = [
    "BACKLOG_CHECK",
    "DEAD_ROWS_CHECK",
    "OUTBOX_ASSET_KEY",
    "UNROUTED_CHECK",
    "DispatchConfig",
    "OutboxHealth",
    "build_dead_rows_check",
    "build_dispatcher_job",
    "dead_rows_evaluation",
    "outbox_asset_spec",
]

OUTBOX_ASSET_KEY = dg.AssetKey("joblease_outbox")
DEAD_ROWS_CHECK = "no_dead_rows"
BACKLOG_CHECK = "delivery_backlog"
UNROUTED_CHECK = "no_unrouted_rows"
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

RoutesSource = Mapping[str, "dispatch.Route"] | Callable[[], Mapping[str, "dispatch.Route"]]


class DispatchConfig(dg.Config):
    """How much one dispatcher run may do before it ends (a bound, so a run never loops forever)."""

    max_batches: int = 50
    batch_size: int = 100


def _md_cell(value: object) -> str:
    return str(value if value is not None else "").replace("|", "\\|").replace("\n", " ")[:200]


def resolve_routes(routes: RoutesSource) -> dict[str, dispatch.Route]:
    """The route map, reading it now when ``routes`` is a callable."""
    return dict(routes() if callable(routes) else routes)


def topic_groups(route_map: Mapping[str, dispatch.Route]) -> dict[str, str]:
    """Topic → limit group of each route (what the due summary needs to leave paused groups out)."""
    return {topic: str(route.limit_group) for topic, route in route_map.items()}


def pause_text(pauses: tuple[outbox.GroupPause, ...]) -> str:
    return "; ".join(p.describe() for p in pauses)


REQUEUE_HINT = (
    "fix the cause, then requeue them deliberately: `joblease outbox requeue --all-dead` (or `--topic "
    "TOPIC`, or one ID); a row dead-lettered past its dedupe_window needs its effect reconciled first"
)


def dead_rows_evaluation(
    engine: sa.Engine, *, limit: int = DEAD_ROWS_SHOWN, topics: tuple[str, ...] | None = None
) -> dg.AssetCheckEvaluation:
    """The ``no_dead_rows`` check: passes when no row (of ``topics``) is DEAD, else names them. SKIPPED rows
    are counted apart (``skipped_rows``) and never fail it."""
    with translate_errors("list dead outbox rows"), engine.connect() as connection:
        count = outbox_store.dead_count(connection, topics)
        skipped = outbox_store.skipped_count(connection, topics)
        rows = outbox_store.dead_rows(connection, topics, limit)
        blocked_count, blocked = delivery_status.blocked_keys(connection, topics=topics, limit=limit)
    lines = [
        "| id | idempotency key | topic | attempts | last status | last error |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.id} | `{r.idempotency_key}` | {_md_cell(r.topic)} | {r.attempts} | "
        f"{_md_cell(r.last_status)} | {_md_cell(r.last_error)} |"
        for r in rows
    ]
    # SKIPPED rows (a person decided they are never sent) are not dead: counted apart, they never fail it.
    meta: dict[str, Any] = {
        "dead_rows": dg.MetadataValue.int(count),
        "skipped_rows": dg.MetadataValue.int(skipped),
    }
    if topics is not None:
        meta["topics"] = dg.MetadataValue.text(", ".join(topics))
    if rows:
        meta["dead"] = dg.MetadataValue.md("\n".join(lines))
        meta["dead_ids"] = dg.MetadataValue.text(", ".join(str(r.id) for r in rows))
    meta["blocked_ordering_keys"] = dg.MetadataValue.int(blocked_count)
    if blocked:
        table = ["| ordering key | blocking row | topic | later rows held |", "|---|---|---|---|"]
        table += [
            f"| `{b.ordering_key}` | {b.blocking_id} | {_md_cell(b.topic)} | {b.held} |" for b in blocked
        ]
        meta["blocked"] = dg.MetadataValue.md("\n".join(table))
    description = (
        "no dead outbox rows"
        if count == 0
        else f"{count} dead outbox row(s); the first: id {rows[0].id}, topic {rows[0].topic}, "
        f"last status {rows[0].last_status}, error {_md_cell(rows[0].last_error)}. Fix the cause, then "
        "requeue them (`joblease outbox requeue --all-dead`), or mark one you decided never to send "
        "SKIPPED (`joblease outbox skip ID`)."
    )
    if skipped:
        description += f" ({skipped} skipped row(s): never sent by a person's decision, not dead.)"
    if blocked:
        description += (
            f" {blocked_count} ordering key(s) blocked, their later rows waiting; the first: "
            f"{blocked[0].describe()}. Requeue the blocking row (`joblease outbox requeue ID`) or give up on "
            "it (`joblease outbox skip ID`)."
        )
    return dg.AssetCheckEvaluation(
        asset_key=OUTBOX_ASSET_KEY,
        check_name=DEAD_ROWS_CHECK,
        passed=count == 0,
        severity=DEAD_ROWS_SEVERITY,
        metadata=meta,
        description=description,
    )


def _age(ms: int | None) -> str:
    return "n/a" if ms is None else f"{ms / 1000:.1f} s"


@dataclasses.dataclass(frozen=True)
class OutboxHealth:
    """The delivery checks of one code location: which topics it routes, and when to WARN.

    Args:
        routes: this location's routes (or a callable returning them, read at evaluation time); the checks
            look only at these topics. ``None``: every topic (a single location owning the whole outbox).
        stale_due_ms: ``delivery_backlog`` warns when the oldest due row has waited longer (default 5 min).
        unrouted_after_ms: ``no_unrouted_rows`` warns when a pending row of a topic this location does not
            route is older than this (default 15 min).
        resource_key: the :class:`JobLeaseResource` key.
    """

    routes: RoutesSource | None = None
    stale_due_ms: int = 5 * 60_000
    unrouted_after_ms: int = 15 * 60_000
    resource_key: str = "joblease"

    def __post_init__(self) -> None:
        checks.milliseconds("OutboxHealth stale_due_ms", self.stale_due_ms)
        checks.milliseconds("OutboxHealth unrouted_after_ms", self.unrouted_after_ms)
        if self.routes is not None and not (callable(self.routes) or isinstance(self.routes, Mapping)):
            raise errors.ConfigurationError(
                f"OutboxHealth routes={self.routes!r} must be a mapping of topic → Route, a callable "
                "returning one, or None (every topic)"
            )

    def topics(self) -> tuple[str, ...] | None:
        """The routed topics (sorted), or ``None`` for every topic."""
        return None if self.routes is None else tuple(sorted(resolve_routes(self.routes)))

    def evaluate(self, engine: sa.Engine) -> list[dg.AssetCheckEvaluation]:
        """All three checks, evaluated now (database clock)."""
        topics = self.topics()
        groups = None if self.routes is None else topic_groups(resolve_routes(self.routes))
        health = outbox.delivery_health(
            engine, topics=topics, unrouted_after_ms=self.unrouted_after_ms, groups=groups
        )
        return [
            dead_rows_evaluation(engine, topics=topics),
            self._backlog(health, topics),
            self._unrouted(health, topics),
        ]

    def _backlog(
        self, health: outbox.DeliveryHealth, topics: tuple[str, ...] | None
    ) -> dg.AssetCheckEvaluation:
        stale = health.oldest_due_age_ms is not None and health.oldest_due_age_ms > self.stale_due_ms
        problems = []
        if health.retrying:
            problems.append(f"{health.retrying} row(s) retrying after a failed delivery attempt")
        if stale:
            problems.append(
                f"the oldest of {health.due} due row(s) has waited {_age(health.oldest_due_age_ms)} "
                f"(threshold {self.stale_due_ms / 1000:g} s): is a dispatcher running?"
            )
        if health.pauses:
            problems.append(
                f"delivery paused by the downstream, {health.paused_due} due row(s) held: "
                f"{pause_text(health.pauses)}"
            )
        meta: dict[str, Any] = {
            "due": dg.MetadataValue.int(health.due),
            "oldest_due_age_ms": dg.MetadataValue.int(health.oldest_due_age_ms or 0),
            "retrying": dg.MetadataValue.int(health.retrying),
            "stale_due_ms": dg.MetadataValue.int(self.stale_due_ms),
        }
        if health.pauses:
            meta["paused_due"] = dg.MetadataValue.int(health.paused_due)
            meta["paused_groups"] = dg.MetadataValue.json([dataclasses.asdict(p) for p in health.pauses])
        if topics is not None:
            meta["topics"] = dg.MetadataValue.text(", ".join(topics))
        return dg.AssetCheckEvaluation(
            asset_key=OUTBOX_ASSET_KEY,
            check_name=BACKLOG_CHECK,
            passed=not problems,
            severity=dg.AssetCheckSeverity.WARN,
            metadata=meta,
            description=(
                "; ".join(problems) + " (see `joblease outbox list --status pending`)"
                if problems
                else f"{health.due} row(s) due, none retrying, oldest {_age(health.oldest_due_age_ms)}"
            ),
        )

    def _unrouted(
        self, health: outbox.DeliveryHealth, topics: tuple[str, ...] | None
    ) -> dg.AssetCheckEvaluation:
        meta: dict[str, Any] = {
            "unrouted_rows": dg.MetadataValue.int(health.unrouted),
            "oldest_unrouted_age_ms": dg.MetadataValue.int(health.oldest_unrouted_age_ms or 0),
            "unrouted_after_ms": dg.MetadataValue.int(self.unrouted_after_ms),
        }
        if health.unrouted_topics:
            meta["unrouted_topics"] = dg.MetadataValue.text(", ".join(health.unrouted_topics))
        if topics is not None:
            meta["topics"] = dg.MetadataValue.text(", ".join(topics))
        return dg.AssetCheckEvaluation(
            asset_key=OUTBOX_ASSET_KEY,
            check_name=UNROUTED_CHECK,
            passed=health.unrouted == 0,
            severity=dg.AssetCheckSeverity.WARN,
            metadata=meta,
            description=(
                f"{health.unrouted} pending row(s) of topics this location does not route "
                f"({', '.join(health.unrouted_topics)}) are older than {self.unrouted_after_ms / 1000:g} s, "
                f"the oldest {_age(health.oldest_unrouted_age_ms)}: give one location a route for them"
                if health.unrouted
                else "no old pending rows of topics this location does not route"
                if topics is not None
                else "this location routes every topic"
            ),
        )

    def asset_checks(self) -> list[dg.AssetChecksDefinition]:
        """The three checks as asset checks on ``joblease_outbox``, runnable on their own from the UI."""
        descriptions = {
            DEAD_ROWS_CHECK: "Fails (ERROR) while a routed outbox row is dead-lettered, and names the rows.",
            BACKLOG_CHECK: "Warns while routed rows are retrying or the oldest due row is older than the "
            "threshold.",
            UNROUTED_CHECK: "Warns while pending rows of topics this location does not route are older than "
            "the threshold.",
        }
        return [self._asset_check(i, name, text) for i, (name, text) in enumerate(descriptions.items())]

    def _asset_check(self, index: int, name: str, description: str) -> dg.AssetChecksDefinition:
        key = self.resource_key

        def _check(context: AssetCheckExecutionContext) -> dg.AssetCheckResult:
            evaluation = self.evaluate(getattr(context.resources, key).engine)[index]
            return dg.AssetCheckResult(
                passed=evaluation.passed,
                severity=evaluation.severity,
                metadata=evaluation.metadata,
                description=evaluation.description,
            )

        check: dg.AssetChecksDefinition = dg.asset_check(
            asset=OUTBOX_ASSET_KEY, name=name, description=description, required_resource_keys={key}
        )(real_annotations(_check, dg.AssetCheckResult, context=AssetCheckExecutionContext))
        return check


def build_dead_rows_check(
    *, resource_key: str = "joblease", routes: RoutesSource | None = None
) -> dg.AssetChecksDefinition:
    """Only the ``no_dead_rows`` check (see :meth:`OutboxHealth.asset_checks` for all three)."""
    return OutboxHealth(routes=routes, resource_key=resource_key).asset_checks()[0]


def _no_run_retry(context: OpExecutionContext) -> None:
    """Tag the run so Dagster's run-retry daemon does not retry it (it reads the tags when the run fails)."""
    try:
        context.instance.add_run_tags(context.run_id, {"dagster/max_retries": "0"})
    except Exception as exc:  # an ephemeral run (direct invocation) has no stored run to tag
        context.log.info(f"could not tag the run against retries: {exc}")


def _verdict(claimed: int, sent: int, due_before: int, paused_due: int = 0) -> str:
    if claimed == 0:
        if due_before == 0 and paused_due:
            return f"{paused_due} due row(s) wait out a downstream's pause; delivered nothing"
        if due_before == 0:
            return "nothing was due for this location's topics; delivered nothing"
        return (
            f"{due_before} row(s) were due but another dispatcher claimed them first; delivered nothing here"
        )
    if sent == 0:
        return f"delivered NOTHING of {claimed} claimed row(s)"
    return f"delivered {sent} of {claimed} claimed row(s)"


def build_dispatcher_job(
    routes: RoutesSource,
    *,
    name: str = "outbox_dispatch_job",
    resource_key: str = "joblease",
    max_attempts: int = 10,
    claim_ms: int = 60_000,
    concurrency: int = 8,
    tags: Mapping[str, str] | None = None,
    health: OutboxHealth | None = None,
    pool: str | None = None,
    max_deferrals: int = dispatch.dispatcher.DEFAULT_MAX_DEFERRALS,
) -> dg.JobDefinition:
    """A job that dispatches due outbox rows of its routed topics until none is claimable.

    ``routes`` maps topics to :class:`Route`; pass a callable to read it (e.g. from the environment)
    when the run starts rather than when the code location loads. Several dispatcher runs at once are
    safe (claims use ``FOR UPDATE SKIP LOCKED``); the sensor simply avoids piling them up.

    A run that claimed rows but delivered none of them (the downstream refuses, every row retried or
    died) **fails** with a retryable :class:`dagster.Failure` after reporting its counts and checks: green
    means something was delivered, or nothing was there to deliver (its metadata says which).
    A run that **dead-lettered** rows fails too, naming how many and how to requeue them, and is *not*
    retried (a retry cannot help): ``Failure(allow_retries=False)`` bypasses an op retry policy and the
    run is tagged ``dagster/max_retries=0`` before it fails, which Dagster's run-retry daemon honours.
    Due rows of topics this location does not route are counted and named in the metadata, without
    failing the run (locations share a database on purpose).
    ``health`` sets the checks' thresholds (default: :class:`OutboxHealth` over ``routes``).

    ``pool`` runs the dispatch op in a Dagster concurrency pool (``dagster instance concurrency set
    POOL N``): it bounds how many dispatcher *runs* Dagster executes at once. It does not bound HTTP
    requests to a downstream; the routes' ``max_in_flight`` and ``rate`` do, across every dispatcher.
    """
    checks = health or OutboxHealth(routes=routes, resource_key=resource_key)

    def _dispatch(context: OpExecutionContext, config: DispatchConfig) -> Iterator[Any]:
        resource = getattr(context.resources, resource_key)
        route_map = resolve_routes(routes)
        topics = tuple(sorted(route_map))
        groups = topic_groups(route_map)
        before = outbox.delivery_health(resource.engine, topics=topics, groups=groups)
        totals = dispatch.DispatchReport()
        batches = 0
        with dispatch.Dispatcher(
            resource.engine,
            route_map,
            max_attempts=max_attempts,
            claim_ms=claim_ms,
            concurrency=concurrency,
            max_deferrals=max_deferrals,
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
        after = outbox.delivery_health(resource.engine, topics=topics, groups=groups)
        unrouted, unrouted_topics = outbox.unrouted_due(resource.engine, topics=topics)
        counts = {"batches": batches} | {
            key: value
            for key, value in dataclasses.asdict(totals).items()
            if key not in ("rows", "paused", "limited")
        }
        counts["due_before"] = before.due
        counts["due_after"] = after.due
        counts["paused_due"] = after.paused_due
        counts["unrouted_due"] = unrouted
        verdict = _verdict(totals.claimed, totals.sent, before.due, before.paused_due)
        if after.pauses:
            context.log.warning(f"delivery paused: {pause_text(after.pauses)}")
        if unrouted:
            context.log.info(
                f"{unrouted} due row(s) of topics this location does not route: "
                f"{', '.join(f'{t} ({n})' for t, n in unrouted_topics.items())} (another location's routes "
                "deliver them; the no_unrouted_rows check warns if they grow old)"
            )
        context.log.info(
            f"{verdict}: claimed {totals.claimed}, sent {totals.sent}, retried {totals.retried}, "
            f"dead {totals.dead} in {batches} batch(es); lost claims {totals.lost_claims}, released "
            f"{totals.released}, unrecorded {totals.unrecorded}; {after.due} still due"
        )
        meta: dict[str, dg.MetadataValue] = {
            key: dg.MetadataValue.int(value) for key, value in counts.items()
        }
        meta["result"] = dg.MetadataValue.text(verdict)
        meta["delivered_nothing"] = dg.MetadataValue.bool(totals.sent == 0)
        meta["topics"] = dg.MetadataValue.text(", ".join(topics))
        if unrouted:
            meta["unrouted_due_topics"] = dg.MetadataValue.json(unrouted_topics)
        if after.pauses:
            meta["paused_groups"] = dg.MetadataValue.json([dataclasses.asdict(p) for p in after.pauses])
        if totals.limited:
            meta["limited_groups"] = dg.MetadataValue.text(", ".join(sorted(totals.limited)))
        # Yielded, not logged: logged events are flushed only when the step succeeds, and a run that
        # delivered nothing must still show its counts and checks.
        yield dg.AssetObservation(asset_key=OUTBOX_ASSET_KEY, metadata=meta)
        yield from checks.evaluate(resource.engine)
        if totals.dead:
            description = (
                f"{totals.dead} outbox row(s) were dead-lettered in this pass ({totals.expired} past their "
                f"route's dedupe_window); {verdict}. They will not be delivered until a person acts: "
                f"{REQUEUE_HINT}. This run is not retried: a retry cannot help."
            )
            _no_run_retry(context)
            raise dg.Failure(description=description, metadata=meta, allow_retries=False)
        if totals.claimed > 0 and totals.sent == 0:
            raise dg.Failure(
                description=(
                    f"{verdict} ({totals.retried} retrying, {totals.dead} dead, {totals.released} given "
                    f"back, {totals.lost_claims} lost claims): the rows are still undelivered. This run "
                    "fails so it does not look like a healthy delivery; the outbox sensor (or a run retry) "
                    "tries again after the rows' backoff."
                ),
                metadata=meta,
                allow_retries=True,
            )
        yield dg.Output(counts, metadata=meta)

    dispatch_op = dg.op(
        name=f"{name}_dispatch",
        pool=pool,
        required_resource_keys={resource_key},
        description="Claim, deliver and record due outbox rows of the routed topics; report the counts.",
    )(real_annotations(_dispatch, context=OpExecutionContext, config=DispatchConfig))

    @dg.job(
        name=name,
        description="Deliver due joblease outbox rows (requested by the outbox sensor).",
        tags={"joblease/role": "dispatcher", **(tags or {})},
    )
    def _job() -> None:
        dispatch_op()

    return _job
