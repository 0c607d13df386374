"""The outcome vocabulary, run tags and step metadata of leased steps: the contract others build on.

Dagster's Partitions view shows the *latest* run per partition, and a recorded skip is a green run there
too; what tells a win from a skip are the ``joblease/*`` run tags (filterable in the Runs list) and the
step's metadata. This module owns their names and values; other modules import them, never redefine them.

**Outcomes.** Per key (partition) of a leased step, exactly one of:

- ``won``: claimed first and did it; ``reclaimed``: took over a FAIL, expired or dead holder and did it;
- ``skipped-succeeded``: another run already did it (the winner is named);
- ``held``: a live holder still had it when the bounded wait ended (retryable failure);
- ``failed``: the body raised (the lease is FAIL, retryable);
- ``lost``: the lease was taken over from under this run, or the run was killed;
- ``not-attempted``: a range run stopped before trying this key;
- ``not-run``: the run's leased step never ran (a re-execution from failure in which only a later step
  ran; an earlier step failed). Written by the reconciliation side (a run-status sensor), not by the step;
- ``pending``: the step has not finished, or the run died before it could say.

``won``, ``reclaimed`` and ``skipped-succeeded`` are *done* (:data:`DONE_OUTCOMES`): the key's effect is
recorded, by this run or provably by another. Everything else is undone and retryable. :data:`OUTCOMES`
lists them most severe first; a run over several keys or leased ops shows the most severe.

**Run tags a leased step writes: three** (:data:`STEP_TAGS`; the budget is four), all of them when the step
starts (``pending``, so tags Dagster copied from a parent run never stand) and again when it ends.
Dagster cannot delete a tag, so every step writes every one of them, ``none`` where it does not apply:

- ``joblease/outcome``: the outcome (the most severe over the run's keys and leased ops), e.g.
  ``joblease/outcome=skipped-succeeded``; values are space-free, so they filter cleanly.
- ``joblease/winner``: the Dagster run id that did the key (this run's own id when it won or reclaimed, the
  other run's on a skip; for a winner that was not a Dagster run, its holder text, at most 63 characters);
  ``multiple`` when the keys of a range were done by different runs; ``none`` when nothing is done.
  Filtering by it shows the winner and every run that skipped because of it.
- ``joblease/work``: the outcome counts over the run's keys, most severe first, e.g.
  ``won:364,skipped-succeeded:1`` (``won:1`` for a single partition). Dagster's own tags name the range
  (``dagster/asset_partition_range_start``/``_end``) or the partition (``dagster/partition``).

Why these names: the Runs list shows Dagster's ``dagster/backfill`` and ``dagster/partition`` first and then
every other tag a person has not hidden, in key order (run storage serialises tags sorted by key; the UI's
``RunTags`` moves only ``mode``, ``dagster/backfill`` and ``dagster/partition`` ahead; other ``dagster/*``
tags are hidden from the table by default). ``outcome`` < ``winner`` < ``work``, so among joblease's tags
the outcome is what a person sees first and the winner second.

Everything else a step knows goes into its metadata (output metadata of an op, the materialization
metadata of an asset partition, and a ``joblease`` engine event of the step, see below): the keys below
(:data:`META_*`), with the winner as :meth:`dagster.MetadataValue.dagster_run`, so it is one click away.

**Launch tags** (:data:`LAUNCH_TAGS`, at most two, on top of the step's): the reconciliation sensor puts
``joblease/relaunch`` (``n/max``) and ``joblease/reconcile_reason`` on the runs it requests. Which sensor
launched a run is Dagster's own ``dagster/sensor_name`` (:data:`TAG_SENSOR_NAME`); the relaunch cap counts a
sensor's runs by that tag and ``parent_run_id is None`` (a re-execution or run retry copies its parent's
tags, the launch tags included: they then describe how its root run was launched), so it depends on no
``joblease/*`` tag. A schedule puts only ``joblease/outcome=pending`` on its requests.

**Several leased ops in one run.** Each step's own truth is its metadata and a ``joblease`` engine event
(:data:`STEP_EVENT_MESSAGE`, metadata :data:`META_OP` and :data:`META_OUTCOMES`) in the run's event log;
the run's tags are computed from those events in one place (``settle_run_tags`` in
:mod:`dagster_joblease.dagster.ops`), never read-modified from the tags themselves (``add_run_tags`` is a
read-modify-write of the whole set).

**Range runs** record every key's outcome in the step metadata: a per-key table up to
:data:`TABLE_MAX_KEYS` keys; past that, counts plus the first :data:`FIRST_KEYS_SHOWN` keys of each outcome.

The names in the *legacy* section at the end are the tag set before the diet; they are kept only while
``ops.py`` moves to the set above (the range helper's work) and are removed then.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import dagster as dg

from dagster_joblease import identity

__all__ = [
    "DONE_OUTCOMES",
    "FAILED",
    "FIRST_KEYS_SHOWN",
    "HELD",
    "INHERITED_RECONCILE_TAGS",
    "LAUNCH_TAGS",
    "LOST",
    "META_ATTEMPT",
    "META_CODE",
    "META_ERROR",
    "META_FIRST_KEYS",
    "META_HOLDER",
    "META_IDEMPOTENCY_KEY",
    "META_KEYS",
    "META_OP",
    "META_OUTBOX",
    "META_OUTCOME",
    "META_OUTCOMES",
    "META_RESULTS",
    "META_RUN_KEY",
    "META_WINNER",
    "MULTIPLE",
    "NONE",
    "NOT_ATTEMPTED",
    "NOT_RUN",
    "OUTBOX_ALREADY_PRESENT",
    "OUTBOX_INSERTED",
    "OUTBOX_NOT_ENQUEUED",
    "OUTBOX_UNKNOWN",
    "OUTCOMES",
    "PENDING",
    "RECLAIMED",
    "RESULT_TAGS",
    "SKIPPED_SUCCEEDED",
    "STEP_EVENT_MESSAGE",
    "STEP_TAGS",
    "TABLE_MAX_KEYS",
    "TAG_ATTEMPT",
    "TAG_CODE",
    "TAG_ERROR",
    "TAG_HOLDER",
    "TAG_IDEMPOTENCY_KEY",
    "TAG_OUTBOX",
    "TAG_OUTCOME",
    "TAG_OUTCOMES",
    "TAG_PARTITIONS",
    "TAG_RECONCILE",
    "TAG_RECONCILE_REASON",
    "TAG_RELAUNCH",
    "TAG_RUN_KEY",
    "TAG_SENSOR_NAME",
    "TAG_WINNER",
    "TAG_WINNER_RUN_ID",
    "TAG_WORK",
    "WON",
    "LeasedResult",
    "format_counts",
    "not_run_tags",
    "op_error_tag",
    "op_outcome_tag",
    "output_metadata",
    "parse_counts",
    "pending_run_tags",
    "pending_tags",
    "result_tags",
    "run_tags",
    "schedule_tags",
    "worst_outcome",
]

# ---- Outcomes --------------------------------------------------------------------------------------------

WON = "won"  #: this run claimed the key first and did it
RECLAIMED = "reclaimed"  #: this run took over after a failed, expired or dead holder, and did it
SKIPPED_SUCCEEDED = "skipped-succeeded"  #: another run already did it (see joblease/winner)
HELD = "held"  #: a live holder still had it when the wait ended: this run failed, retryably
FAILED = "failed"  #: this run's body raised (or it was interrupted): the lease is FAIL, retryable
LOST = "lost"  #: this run lost its lease (reclaimed from under it, or it was killed)
NOT_ATTEMPTED = "not-attempted"  #: a range run stopped before trying this key
NOT_RUN = "not-run"  #: the run's leased step never ran (written by the reconciliation side)
PENDING = "pending"  #: the leased step has not finished yet (or the run died before it could say)

#: Most severe first: a run over several keys or ops shows the first that applies.
OUTCOMES = (LOST, FAILED, HELD, NOT_ATTEMPTED, NOT_RUN, PENDING, RECLAIMED, WON, SKIPPED_SUCCEEDED)
#: The key's effect is recorded, by this run or (a skip) provably by another.
DONE_OUTCOMES = frozenset({WON, RECLAIMED, SKIPPED_SUCCEEDED})

# ---- Run tags --------------------------------------------------------------------------------------------

TAG_OUTCOME = "joblease/outcome"
TAG_WINNER = "joblease/winner"
TAG_WORK = "joblease/work"
#: Every run tag a leased step writes (all of them, at its start and its end): at most four by contract.
STEP_TAGS = (TAG_OUTCOME, TAG_WINNER, TAG_WORK)

#: Put on at launch by the reconciliation sensor (:mod:`dagster_joblease.dagster.reconcile`).
TAG_RELAUNCH = "joblease/relaunch"
TAG_RECONCILE_REASON = "joblease/reconcile_reason"
#: At most two, on top of :data:`STEP_TAGS`.
LAUNCH_TAGS = (TAG_RELAUNCH, TAG_RECONCILE_REASON)
#: Dagster's own tag naming the sensor that launched a run (not a joblease tag); the relaunch cap counts
#: by it.
TAG_SENSOR_NAME = "dagster/sensor_name"

# ---- Step metadata keys (op output, asset materialization, the step's joblease engine event) ------------

META_OUTCOME = "joblease/outcome"
META_WINNER = "joblease/winner"  #: MetadataValue.dagster_run(winner) (text for a non-Dagster winner)
META_CODE = "joblease/code"
META_RUN_KEY = "joblease/run_key"
META_IDEMPOTENCY_KEY = "joblease/idempotency_key"
META_ATTEMPT = "joblease/attempt"
META_HOLDER = "joblease/holder"
META_ERROR = "joblease/error"
META_OUTBOX = "joblease/outbox"
META_KEYS = "joblease/keys"  #: how many keys the step covered
META_OUTCOMES = "joblease/outcomes"  #: JSON object outcome -> count
META_FIRST_KEYS = "joblease/first_keys"  #: JSON object outcome -> its first keys (past TABLE_MAX_KEYS)
META_RESULTS = "joblease/results"  #: markdown table, one row per key (up to TABLE_MAX_KEYS)
META_OP = "joblease/op"  #: the leased op's name (in the step's engine event)
#: The message of the engine event each leased step logs with its outcome counts (the per-op truth).
STEP_EVENT_MESSAGE = "joblease step outcome"
TABLE_MAX_KEYS = 300
FIRST_KEYS_SHOWN = 20

OUTBOX_INSERTED = "inserted"
OUTBOX_ALREADY_PRESENT = "already-present"
OUTBOX_NOT_ENQUEUED = "not-enqueued"
#: On a ``lost`` run: it was killed mid-step, so whether it enqueued is not known from the run.
OUTBOX_UNKNOWN = "unknown"

MULTIPLE = "multiple"  #: a value over several keys or leased ops that differ
NONE = "none"  #: a tag that does not apply to this outcome
MAX_ERROR_TAG_CHARS = 200
MAX_TAG_VALUE_CHARS = 63

# ---- Legacy tag set (before the tag diet); removed once ops.py writes STEP_TAGS only -------------------

TAG_CODE = "joblease/code"  #: also the op tag that marks an op as leased (kept after the diet)
TAG_RUN_KEY = "joblease/run_key"
TAG_IDEMPOTENCY_KEY = "joblease/idempotency_key"
TAG_ATTEMPT = "joblease/attempt"
TAG_OUTBOX = "joblease/outbox"
TAG_HOLDER = "joblease/holder"
TAG_WINNER_RUN_ID = "joblease/winner_run_id"
TAG_ERROR = "joblease/error"
TAG_PARTITIONS = "joblease/partitions"
TAG_OUTCOMES = "joblease/outcomes"
#: Legacy: after the diet, which sensor launched a run is Dagster's ``dagster/sensor_name``.
TAG_RECONCILE = "joblease/reconciled_by"

#: Legacy: every tag a leased step (over)writes; a re-execution's copies of the parent's are all replaced.
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
#: Legacy: Dagster copies every parent tag into a re-execution or a run retry; these say the copy is not a
#: relaunch.
INHERITED_RECONCILE_TAGS = {TAG_RECONCILE: NONE, TAG_RELAUNCH: NONE, TAG_RECONCILE_REASON: NONE}


def format_counts(counts: Mapping[str, int]) -> str:
    """``won:364,skipped-succeeded:1``: counts, most severe first, zeros left out (``none`` if empty)."""
    order = {o: i for i, o in enumerate(OUTCOMES)}
    items = sorted(((k, n) for k, n in counts.items() if n), key=lambda kv: (order.get(kv[0], 99), kv[0]))
    return ",".join(f"{k}:{n}" for k, n in items) or NONE


def parse_counts(text: str) -> dict[str, int]:
    """The inverse of :func:`format_counts` (``none`` or an empty string: no counts)."""
    counts: dict[str, int] = {}
    if text in ("", NONE):
        return counts
    for part in text.split(","):
        outcome, sep, number = part.rpartition(":")
        if not sep or not number.isdigit():
            raise ValueError(f"{text!r} is not outcome counts like 'won:3,skipped-succeeded:1'")
        counts[outcome] = counts.get(outcome, 0) + int(number)
    return counts


def run_tags(counts: Mapping[str, int], winner: str | None) -> dict[str, str]:
    """The :data:`STEP_TAGS` for a run whose keys came to ``counts`` and whose winner is ``winner``.

    ``winner`` is a Dagster run id, a holder text, :data:`MULTIPLE`, or ``None`` (``none``).
    """
    label = winner or NONE
    return {
        TAG_OUTCOME: worst_outcome(k for k, n in counts.items() if n),
        TAG_WINNER: label if len(label) <= MAX_TAG_VALUE_CHARS else label[: MAX_TAG_VALUE_CHARS - 1] + "…",
        TAG_WORK: format_counts(counts),
    }


def pending_run_tags(keys: int) -> dict[str, str]:
    """The :data:`STEP_TAGS` a leased step writes when it starts over ``keys`` keys."""
    return run_tags({PENDING: keys}, None)


def not_run_tags(keys: int = 1) -> dict[str, str]:
    """The :data:`STEP_TAGS` for a run whose leased step never ran (``keys``: how many it covered)."""
    return run_tags({NOT_RUN: keys}, None)


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
        return self.outcome in DONE_OUTCOMES


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
