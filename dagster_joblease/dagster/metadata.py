"""Run tags and metadata that make the lease outcome visible, and truthful, in the Dagster UI.

Dagster's Partitions view shows the *latest* run per partition, and a recorded skip is a successful run
there too; what tells the winner from the duplicates are these ``joblease/...`` tags (filterable in the
Runs list) and the op/asset output metadata. Dagster copies a parent's tags onto a re-execution and
cannot delete tags, so a leased step overwrites every tag below when it starts (``pending``), and again
when it ends, whether it succeeded, skipped, failed or lost its lease.

Tags (values are space-free, so ``joblease/outcome=skipped-succeeded`` filters cleanly):

- ``joblease/outcome``: ``won``, ``reclaimed``, ``skipped-succeeded``, ``held``, ``failed``, ``lost`` or
  ``pending`` (see the constants below).
- ``joblease/code``, ``joblease/run_key``, ``joblease/idempotency_key``, ``joblease/attempt``.
- ``joblease/holder``: the holder this outcome is about (this run's own ``dagster:<deployment>/<run_id>``
  when it won; the winner's on a skip; the live holder on ``held``).
- ``joblease/winner_run_id``: the Dagster run that did the partition (this run when it won; the winner on
  a skip; ``none`` otherwise or when the winner was not a Dagster run).
- ``joblease/error``: bounded error text of ``held``, ``failed`` or ``lost`` (``none`` otherwise).
- ``joblease/outbox``: ``inserted``, ``already-present``, ``not-enqueued``.
- ``joblease/partitions`` and ``joblease/outcomes``: how many keys the run covered and its outcome counts
  (``won:4,skipped-succeeded:1``).

A run over several keys (a single-run backfill of a partition range) gets the most severe outcome of its
keys (``lost`` > ``failed`` > ``held`` > ``pending`` > ``reclaimed`` > ``won`` > ``skipped-succeeded``),
``joblease/run_key=<first>..<last>``, and ``multiple`` for the per-key tags (idempotency key, attempt,
winner, outbox); the per-key facts are in the output metadata table. A job with several leased ops also
gets ``joblease/outcome.<op name>`` per op; ``joblease/outcome`` is then the most severe over the ops.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import dagster as dg

from dagster_joblease import identity

__all__ = [
    "FAILED",
    "HELD",
    "LOST",
    "MULTIPLE",
    "NONE",
    "OUTBOX_ALREADY_PRESENT",
    "OUTBOX_INSERTED",
    "OUTBOX_NOT_ENQUEUED",
    "OUTCOMES",
    "PENDING",
    "RECLAIMED",
    "RESULT_TAGS",
    "SKIPPED_SUCCEEDED",
    "TAG_ATTEMPT",
    "TAG_CODE",
    "TAG_ERROR",
    "TAG_HOLDER",
    "TAG_IDEMPOTENCY_KEY",
    "TAG_OUTBOX",
    "TAG_OUTCOME",
    "TAG_OUTCOMES",
    "TAG_PARTITIONS",
    "TAG_RUN_KEY",
    "TAG_WINNER_RUN_ID",
    "WON",
    "LeasedResult",
    "op_error_tag",
    "op_outcome_tag",
    "output_metadata",
    "pending_tags",
    "result_tags",
    "schedule_tags",
    "worst_outcome",
]

TAG_CODE = "joblease/code"
TAG_RUN_KEY = "joblease/run_key"
TAG_IDEMPOTENCY_KEY = "joblease/idempotency_key"
TAG_OUTCOME = "joblease/outcome"
TAG_ATTEMPT = "joblease/attempt"
TAG_OUTBOX = "joblease/outbox"
TAG_HOLDER = "joblease/holder"
TAG_WINNER_RUN_ID = "joblease/winner_run_id"
TAG_ERROR = "joblease/error"
TAG_PARTITIONS = "joblease/partitions"
TAG_OUTCOMES = "joblease/outcomes"

#: Every tag a leased step (over)writes; a re-execution's copies of the parent's are all replaced.
RESULT_TAGS = (
    TAG_OUTCOME,
    TAG_CODE,
    TAG_RUN_KEY,
    TAG_IDEMPOTENCY_KEY,
    TAG_ATTEMPT,
    TAG_HOLDER,
    TAG_WINNER_RUN_ID,
    TAG_ERROR,
    TAG_OUTBOX,
    TAG_PARTITIONS,
    TAG_OUTCOMES,
)

WON = "won"  #: this run claimed the partition first and did it
RECLAIMED = "reclaimed"  #: this run took over after a failed, expired or dead holder, and did it
SKIPPED_SUCCEEDED = "skipped-succeeded"  #: another run already did it (see joblease/winner_run_id)
HELD = "held"  #: a live holder still had it when the wait ended: this run failed, retryably
FAILED = "failed"  #: this run's body raised (or it was interrupted): the lease is FAIL, retryable
LOST = "lost"  #: this run lost its lease (reclaimed from under it, or it was killed)
PENDING = "pending"  #: the leased step has not finished yet (or the run died before it could say)

#: Most severe first: a run over several keys or ops shows the first that applies.
OUTCOMES = (LOST, FAILED, HELD, PENDING, RECLAIMED, WON, SKIPPED_SUCCEEDED)

OUTBOX_INSERTED = "inserted"
OUTBOX_ALREADY_PRESENT = "already-present"
OUTBOX_NOT_ENQUEUED = "not-enqueued"

MULTIPLE = "multiple"  #: a per-key tag on a run over several keys or leased ops
NONE = "none"  #: a tag that does not apply to this outcome
MAX_ERROR_TAG_CHARS = 200


@dataclasses.dataclass(frozen=True)
class LeasedResult:
    """What one logical run (one partition key, or the INITIAL run) came to in this Dagster run.

    ``outcome`` is one of :data:`OUTCOMES`; ``attempt`` is the lease's attempt (for a skip or ``held``,
    the attempt that finished or holds it); ``outbox`` is ``inserted``, ``already-present`` or
    ``not-enqueued``; ``holder`` and ``winner_run_id`` as in the ``joblease/holder`` and
    ``joblease/winner_run_id`` tags; ``error`` for ``held``, ``failed`` and ``lost``.
    """

    code: str
    partition_key: str | None
    idempotency_key: str
    outcome: str
    attempt: int | None
    outbox: str
    result: Any = None
    holder: str | None = None
    winner_run_id: str | None = None
    error: str | None = None

    @property
    def acquired(self) -> bool:
        return self.outcome in (WON, RECLAIMED)

    @property
    def skipped(self) -> bool:
        return self.outcome == SKIPPED_SUCCEEDED

    @property
    def done(self) -> bool:
        """The partition's effect is recorded (by this run or, for a skip, by the winner)."""
        return self.acquired or self.skipped


def worst_outcome(outcomes: Iterable[str]) -> str:
    """The most severe of ``outcomes`` (see :data:`OUTCOMES`); ``pending`` for none."""
    seen = set(outcomes)
    return next((o for o in OUTCOMES if o in seen), PENDING)


def op_outcome_tag(op_name: str) -> str:
    """``joblease/outcome.<op name>``: one op's outcome in a job with several leased ops."""
    return f"{TAG_OUTCOME}.{op_name}"[: len("joblease/") + 63]


def op_error_tag(op_name: str) -> str:
    """``joblease/error.<op name>``: one op's error in a job with several leased ops."""
    return f"{TAG_ERROR}.{op_name}"[: len("joblease/") + 63]


def _per_op(tags: dict[str, str], op_name: str) -> dict[str, str]:
    """Several leased ops: this op's outcome and error move to op-scoped tags (the run's are aggregates)."""
    tags[op_outcome_tag(op_name)] = tags.pop(TAG_OUTCOME)
    tags[op_error_tag(op_name)] = tags[TAG_ERROR]
    tags[TAG_ERROR] = MULTIPLE
    return tags


def bound_tag_text(text: str, limit: int = MAX_ERROR_TAG_CHARS) -> str:
    """One line, at most ``limit`` characters: a tag is a label, the full text is in the logs."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def schedule_tags(code: str, partition_key: str) -> dict[str, str]:
    """Tags a schedule puts on a run request: the lease code, run key and idempotency key, and pending."""
    job = identity.JobIdentity.schedule(code, partition_key)
    return {
        TAG_CODE: job.code,
        TAG_RUN_KEY: partition_key,
        TAG_IDEMPOTENCY_KEY: job.idempotency_key,
        TAG_OUTCOME: PENDING,
    }


def outbox_label(results: Sequence[bool]) -> str:
    """``inserted`` / ``already-present`` for what ``enqueue_once`` returned; mixed lists are counted."""
    if not results:
        return OUTBOX_NOT_ENQUEUED
    inserted = sum(1 for r in results if r)
    if inserted == len(results):
        return OUTBOX_INSERTED
    if inserted == 0:
        return OUTBOX_ALREADY_PRESENT
    return f"{OUTBOX_INSERTED}:{inserted},{OUTBOX_ALREADY_PRESENT}:{len(results) - inserted}"


def _counts(labels: Iterable[str]) -> str:
    counts = collections.Counter(labels)
    order = {o: i for i, o in enumerate(OUTCOMES)}
    return ",".join(
        f"{label}:{n}" for label, n in sorted(counts.items(), key=lambda kv: order.get(kv[0], 99))
    )


def _run_key_label(keys: Sequence[str | None]) -> str:
    if not keys:
        return NONE
    if len(keys) == 1:
        return keys[0] or NONE
    return f"{keys[0]}..{keys[-1]}"


def pending_tags(
    code: str, jobs: Sequence[identity.JobIdentity], *, several_ops: bool, op_name: str
) -> dict[str, str]:
    """The tags a leased step writes when it starts: what is known (code, keys), ``pending`` for the rest."""
    single = len(jobs) == 1 and not several_ops
    tags = {
        TAG_OUTCOME: PENDING,
        TAG_CODE: MULTIPLE if several_ops else code,
        TAG_RUN_KEY: _run_key_label([j.run_key for j in jobs]),
        TAG_IDEMPOTENCY_KEY: jobs[0].idempotency_key if single else MULTIPLE,
        TAG_ATTEMPT: PENDING,
        TAG_HOLDER: PENDING,
        TAG_WINNER_RUN_ID: PENDING,
        TAG_ERROR: NONE,
        TAG_OUTBOX: PENDING,
        TAG_PARTITIONS: str(len(jobs)),
        TAG_OUTCOMES: f"{PENDING}:{len(jobs)}",
    }
    return _per_op(tags, op_name) if several_ops else tags


def result_tags(
    results: Sequence[LeasedResult],
    *,
    own_holder: str | None = None,
    several_ops: bool = False,
    op_name: str = "",
) -> dict[str, str]:
    """Run tags for a step's results (see the module docstring for a run over several keys or ops)."""
    if not results:
        return {}
    single = len(results) == 1 and not several_ops
    errors = [f"{r.partition_key}: {r.error}" if len(results) > 1 else r.error for r in results if r.error]
    tags = {
        TAG_OUTCOME: worst_outcome(r.outcome for r in results),
        TAG_CODE: MULTIPLE if several_ops else results[0].code,
        TAG_RUN_KEY: _run_key_label([r.partition_key for r in results]),
        TAG_ERROR: bound_tag_text(errors[0]) if errors else NONE,
        TAG_PARTITIONS: str(len(results)),
        TAG_OUTCOMES: _counts(r.outcome for r in results),
    }
    if single:
        (only,) = results
        tags.update(
            {
                TAG_IDEMPOTENCY_KEY: only.idempotency_key,
                TAG_ATTEMPT: str(only.attempt) if only.attempt is not None else NONE,
                TAG_HOLDER: only.holder or NONE,
                TAG_WINNER_RUN_ID: only.winner_run_id or NONE,
                TAG_OUTBOX: only.outbox,
            }
        )
    else:
        tags.update(
            {
                TAG_IDEMPOTENCY_KEY: MULTIPLE,
                TAG_ATTEMPT: MULTIPLE,
                TAG_HOLDER: own_holder or MULTIPLE,
                TAG_WINNER_RUN_ID: MULTIPLE,
                TAG_OUTBOX: MULTIPLE if several_ops else _counts(r.outbox for r in results),
            }
        )
    return _per_op(tags, op_name) if several_ops else tags


def _table(results: Sequence[LeasedResult]) -> str:
    lines = [
        "| partition | outcome | attempt | outbox | winner run | idempotency key |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.partition_key or '(initial)'} | {r.outcome} | {r.attempt or ''} | {r.outbox} | "
        f"{r.winner_run_id or ''} | `{r.idempotency_key}` |"
        for r in results
    ]
    return "\n".join(lines)


def output_metadata(results: Sequence[LeasedResult]) -> dict[str, dg.MetadataValue]:
    """Op/asset output metadata: the same facts as the tags, plus a per-key table for a range run."""
    meta: dict[str, dg.MetadataValue] = {
        key: dg.MetadataValue.text(value) for key, value in result_tags(results).items()
    }
    if len(results) == 1 and results[0].attempt is not None:
        meta[TAG_ATTEMPT] = dg.MetadataValue.int(results[0].attempt)
    counts: Mapping[str, int] = collections.Counter(r.outcome for r in results)
    meta["joblease/won"] = dg.MetadataValue.int(counts.get(WON, 0) + counts.get(RECLAIMED, 0))
    meta["joblease/skipped"] = dg.MetadataValue.int(counts.get(SKIPPED_SUCCEEDED, 0))
    if len(results) > 1:
        meta["joblease/results"] = dg.MetadataValue.md(_table(results))
    return meta
