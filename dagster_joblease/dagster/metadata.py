"""The outcome vocabulary, run tags and step metadata of leased steps: the contract others build on.

Dagster's Partitions view shows the *latest* run per partition, and a recorded skip is a green run there
too; what tells a win from a skip are the ``joblease/*`` run tags (filterable in the Runs list) and the
step's metadata. This module owns their names and values; other modules import them, never redefine them.
A skipped key also says so first, where the run page shows it: the step's log line and engine event
start with :func:`skip_note` (``skipped: done by run X``), and a leased asset records the skip as an
asset observation (:func:`skip_observations`), and as a materialization only where Dagster needs one
(``asset_recording`` in :mod:`dagster_joblease.dagster.ops` decides).

**Outcomes.** Per key (partition) of a leased step, exactly one of:

- ``won``: claimed first and did it; ``reclaimed``: took over a FAIL, expired or dead holder and did it;
- ``skipped-succeeded``: another run already did it (the winner is named);
- ``held``: a live holder still had it when the bounded wait ended (retryable failure);
- ``failed``: the body raised (the lease is FAIL, retryable);
- ``lost``: the lease was taken over from under this run, or the run was killed;
- ``not-attempted``: this run never held the key (a range stopped before it, or the run was terminated
  before its body ran, also while waiting for a live holder);
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

Before the diet a step wrote eleven tags (``joblease/code``, ``run_key``, ``idempotency_key``, ``attempt``,
``holder``, ``winner_run_id``, ``error``, ``outbox``, ``partitions``, ``outcomes``, ``outcome.<op>``);
runs recorded then keep them, and a leased step never writes them again. ``joblease/code`` remains the *op*
tag marking a leased op.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import dagster as dg

from dagster_joblease import identity
from dagster_joblease.dagster.holders import decode_holder
from dagster_joblease.waiting import WaitOutcome

__all__ = [
    "DONE_OUTCOMES",
    "FAILED",
    "FIRST_KEYS_SHOWN",
    "HELD",
    "LAUNCH_TAGS",
    "LOST",
    "META_ATTEMPT",
    "META_CODE",
    "META_ERROR",
    "META_FIRST_KEYS",
    "META_HELD_BY",
    "META_HOLDER",
    "META_IDEMPOTENCY_KEY",
    "META_KEYS",
    "META_OP",
    "META_OUTBOX",
    "META_OUTCOME",
    "META_OUTCOMES",
    "META_RESULTS",
    "META_RUN_KEY",
    "META_SKIPPED",
    "META_SKIPPED_DONE_BY",
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
    "SKIPPED_SUCCEEDED",
    "STEP_EVENT_MESSAGE",
    "STEP_TAGS",
    "TABLE_MAX_KEYS",
    "TAG_CODE",
    "TAG_OUTCOME",
    "TAG_RECONCILE_REASON",
    "TAG_RELAUNCH",
    "TAG_SENSOR_NAME",
    "TAG_WINNER",
    "TAG_WORK",
    "WON",
    "LeasedResult",
    "bound_tag_text",
    "format_counts",
    "not_run_tags",
    "outbox_label",
    "outcome_counts",
    "parse_counts",
    "pending_run_tags",
    "run_tags",
    "schedule_tags",
    "skip_note",
    "skip_observations",
    "skip_summary",
    "step_metadata",
    "winner_label",
    "winner_of",
    "worst_outcome",
]

# ---- Outcomes --------------------------------------------------------------------------------------------

# The wait engine's outcomes (dagster_joblease.waiting.WaitOutcome), as the step records them.
WON: str = WaitOutcome.WON.value  #: this run claimed the key first and did it
RECLAIMED: str = (
    WaitOutcome.RECLAIMED.value
)  #: this run took over after a failed, expired or dead holder, and did it
SKIPPED_SUCCEEDED: str = (
    WaitOutcome.SKIPPED_SUCCEEDED.value
)  #: another run already did it (see joblease/winner)
HELD: str = (
    WaitOutcome.HELD.value
)  #: a live holder still had it when the wait ended: this run failed, retryably
#: this run held the key and its body raised (or it was interrupted): the lease is FAIL, retryable
FAILED: str = WaitOutcome.FAILED.value
LOST: str = WaitOutcome.LOST.value  #: this run lost its lease (reclaimed from under it, or it was killed)
#: this run never held the key (a range stopped; or terminated, or its database failed, while it claimed
#: or waited for another holder, whose lease stays RUNNING)
NOT_ATTEMPTED: str = WaitOutcome.NOT_ATTEMPTED.value
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
#: On a ``held`` step: the live holder it waited for, a run link when it is a Dagster run (text for a
#: holder outside Dagster; ``multiple`` when the held keys of a range had different holders).
META_HELD_BY = "joblease/held_by"
META_ERROR = "joblease/error"
META_OUTBOX = "joblease/outbox"
META_KEYS = "joblease/keys"  #: how many keys the step covered
META_OUTCOMES = "joblease/outcomes"  #: JSON object outcome -> count
META_FIRST_KEYS = "joblease/first_keys"  #: JSON object outcome -> its first keys (past TABLE_MAX_KEYS)
META_RESULTS = "joblease/results"  #: markdown table, one row per key (up to TABLE_MAX_KEYS)
META_OP = "joblease/op"  #: the leased op's name (in the step's engine event)
#: A skipped key's :func:`skip_note` (``skipped: done by run …``): the first entry of its asset observation
#: and of a materialization recorded for it.
META_SKIPPED = "joblease/skipped"
#: On a skipped key's asset observation: the run that did the key (a run link; a non-Dagster winner's
#: holder as text). Not :data:`META_WINNER`: Dagster's partition page shows an observation's entry in place
#: of the latest materialization's entry of the same label, and the win's must stay what it shows.
META_SKIPPED_DONE_BY = "joblease/skipped_done_by"
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

#: The op tag (on the op definition, not the run) that marks an op as leased, valued with its lease code.
TAG_CODE = "joblease/code"


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
    ``not-enqueued``; ``holder`` the lease holder this outcome is about (this run's when it claimed, the
    winner's on a skip, the live holder's on ``held``); ``winner_run_id`` the Dagster run that did the key
    (``joblease/winner``); ``error`` for ``held``, ``failed`` and ``lost``.
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


def bound_tag_text(text: str, limit: int = MAX_ERROR_TAG_CHARS) -> str:
    """One line, at most ``limit`` characters: a label; the full text is in the logs."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def schedule_tags(code: str, partition_key: str) -> dict[str, str]:
    """Tags a schedule (or the reconciliation sensor) puts on a run request: ``joblease/outcome=pending``.

    ``code`` and ``partition_key`` are validated (they name the run's lease); the partition itself is
    Dagster's ``dagster/partition``, the lease code is in the leased op's tags and the step's metadata.
    """
    identity.JobIdentity.schedule(code, partition_key)
    return {TAG_OUTCOME: PENDING}


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


def _run_key_label(keys: Sequence[str | None]) -> str:
    if not keys:
        return NONE
    if len(keys) == 1:
        return keys[0] or NONE
    return f"{keys[0]}..{keys[-1]}"


def winner_of(result: LeasedResult) -> str | None:
    """The run (or, for a winner outside Dagster, the holder) that did ``result``'s key; None if undone."""
    if not result.done:
        return None
    return result.winner_run_id or result.holder


def winner_label(results: Sequence[LeasedResult]) -> str | None:
    """The winner of every done key when it is one run, :data:`MULTIPLE` for several, None for none."""
    winners = {w for w in (winner_of(r) for r in results) if w}
    if not winners:
        return None
    return winners.pop() if len(winners) == 1 else MULTIPLE


def skip_note(result: LeasedResult) -> str | None:
    """``skipped: done by run <id>; <code>@<partition> was already done …`` for a skipped key, else None.

    What the run page shows first for a key another run did (the step's log line, its engine event, the
    asset observation's description): the word *skipped* and the winner, before anything else.
    """
    if not result.skipped:
        return None
    winner = winner_of(result)
    by = f"run {result.winner_run_id}" if result.winner_run_id else (winner or "another holder")
    key = f"{result.code}@{result.partition_key}" if result.partition_key else f"{result.code} (initial)"
    attempt = f", attempt {result.attempt}" if result.attempt is not None else ""
    return f"skipped: done by {by}; {key} was already done (lease SUCCESS{attempt}), not done again here"


def skip_summary(results: Sequence[LeasedResult]) -> str | None:
    """The step's skip in one line (None when no key was skipped): :func:`skip_note` for one key;
    ``skipped 2 of 3 keys: done by run <id>`` (or ``by N other runs``) for a range."""
    skipped = [r for r in results if r.skipped]
    if not skipped:
        return None
    if len(results) == 1:
        return skip_note(skipped[0])
    winners = sorted({w for w in (winner_of(r) for r in skipped) if w})
    if len(winners) == 1:
        (only,) = winners
        by = f"run {only}" if any(r.winner_run_id == only for r in skipped) else only
    else:
        by = f"{len(winners)} other runs"
    return f"skipped {len(skipped)} of {len(results)} keys: done by {by}"


def skip_observations(asset_key: dg.AssetKey, results: Sequence[LeasedResult]) -> list[dg.AssetObservation]:
    """One :class:`dagster.AssetObservation` per skipped key (up to :data:`TABLE_MAX_KEYS`): a skip is
    *observed*, so it does not look like a win. Its description and first metadata entry
    (:data:`META_SKIPPED`) are :func:`skip_note`; the winner is a run link under
    :data:`META_SKIPPED_DONE_BY`. Its labels are none of a materialization's (no ``joblease/outcome``,
    no ``joblease/winner``): Dagster's partition page lets a newer observation's entry replace the latest
    materialization's entry of the same label, and the partition's win stays what the page shows."""
    observations = []
    for r in [r for r in results if r.skipped][:TABLE_MAX_KEYS]:
        note = skip_note(r) or SKIPPED_SUCCEEDED
        observations.append(
            dg.AssetObservation(
                asset_key=asset_key,
                partition=r.partition_key,
                description=note,
                metadata={
                    META_SKIPPED: dg.MetadataValue.text(note),
                    META_SKIPPED_DONE_BY: _winner_value(winner_of(r), [r]),
                },
            )
        )
    return observations


def outcome_counts(results: Iterable[LeasedResult]) -> dict[str, int]:
    """``{outcome: number of keys}`` over ``results``."""
    return dict(collections.Counter(r.outcome for r in results))


def _winner_value(winner: str | None, results: Sequence[LeasedResult]) -> dg.MetadataValue:
    """A Dagster run is one click away (``MetadataValue.dagster_run``); anything else is text."""
    run_ids = {r.winner_run_id for r in results if r.done}
    if winner and run_ids == {winner}:
        return dg.MetadataValue.dagster_run(winner)
    return dg.MetadataValue.text(winner or NONE)


def _table(results: Sequence[LeasedResult]) -> str:
    lines = [
        "| partition | outcome | attempt | outbox | winner run | idempotency key |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.partition_key or '(initial)'} | {r.outcome} | {r.attempt or ''} | {r.outbox} | "
        f"{r.winner_run_id or (r.holder if r.done else '') or ''} | `{r.idempotency_key}` |"
        for r in results
    ]
    return "\n".join(lines)


def step_metadata(
    results: Sequence[LeasedResult], *, per_key_table: bool = True
) -> dict[str, dg.MetadataValue]:
    """A leased step's metadata: every fact the run tags leave out, and every key's outcome.

    One key: its outcome, winner (a link to the winner's run), code, run key, idempotency key, attempt,
    holder, outbox result and error; a ``held`` step also the holder it waited for (:data:`META_HELD_BY`,
    a run link). Several keys (a range): the worst outcome, the winner (or
    ``multiple``), code, the range, the number of keys, the counts per outcome, the first error, and a
    per-key table up to :data:`TABLE_MAX_KEYS` keys; past that (or with ``per_key_table=False``), the
    first :data:`FIRST_KEYS_SHOWN` keys of each outcome instead.
    """
    if not results:
        return {}
    error = first_error(results)
    meta: dict[str, dg.MetadataValue] = {
        META_OUTCOME: dg.MetadataValue.text(worst_outcome(r.outcome for r in results)),
        META_WINNER: _winner_value(winner_label(results), results),
        META_CODE: dg.MetadataValue.text(results[0].code),
        META_RUN_KEY: dg.MetadataValue.text(_run_key_label([r.partition_key for r in results])),
        META_ERROR: dg.MetadataValue.text(NONE if error is None else bound_tag_text(error)),
    }
    held_by = held_by_value(results)
    if held_by is not None:
        meta[META_HELD_BY] = held_by
    if len(results) == 1:
        return {**meta, **_one_key_metadata(results[0])}
    return {**meta, **_range_metadata(results, per_key_table=per_key_table)}


def held_by_value(results: Sequence[LeasedResult]) -> dg.MetadataValue | None:
    """The live holder the ``held`` keys waited for (None when no key is held): a link to its Dagster run,
    one click away like a skip's winner; its text for a holder outside Dagster; :data:`MULTIPLE` for
    several holders."""
    holders = {r.holder or NONE for r in results if r.outcome == HELD}
    if not holders:
        return None
    if len(holders) > 1:
        return dg.MetadataValue.text(MULTIPLE)
    (holder,) = holders
    decoded = decode_holder(holder)
    return dg.MetadataValue.text(holder) if decoded is None else dg.MetadataValue.dagster_run(decoded.run_id)


def first_error(results: Sequence[LeasedResult]) -> str | None:
    """The first key's error, as the step shows it: prefixed with its partition key in a range."""
    for r in results:
        if r.error:
            return f"{r.partition_key}: {r.error}" if len(results) > 1 else r.error
    return None


def _one_key_metadata(only: LeasedResult) -> dict[str, dg.MetadataValue]:
    return {
        META_IDEMPOTENCY_KEY: dg.MetadataValue.text(only.idempotency_key),
        META_ATTEMPT: dg.MetadataValue.text(NONE)
        if only.attempt is None
        else dg.MetadataValue.int(only.attempt),
        META_HOLDER: dg.MetadataValue.text(only.holder or NONE),
        META_OUTBOX: dg.MetadataValue.text(only.outbox),
    }


def _range_metadata(results: Sequence[LeasedResult], *, per_key_table: bool) -> dict[str, dg.MetadataValue]:
    meta: dict[str, dg.MetadataValue] = {
        META_KEYS: dg.MetadataValue.int(len(results)),
        META_OUTCOMES: dg.MetadataValue.json(outcome_counts(results)),
        META_OUTBOX: dg.MetadataValue.text(
            ",".join(f"{k}:{n}" for k, n in sorted(collections.Counter(r.outbox for r in results).items()))
        ),
    }
    if per_key_table and len(results) <= TABLE_MAX_KEYS:
        meta[META_RESULTS] = dg.MetadataValue.md(_table(results))
    else:
        meta[META_FIRST_KEYS] = dg.MetadataValue.json(first_keys(results))
    return meta


def first_keys(results: Sequence[LeasedResult]) -> dict[str, list[str]]:
    """The first :data:`FIRST_KEYS_SHOWN` keys of each outcome (``(initial)`` for the INITIAL run), the
    outcomes in :data:`OUTCOMES` order."""
    first: dict[str, list[str]] = {}
    for r in results:
        shown = first.setdefault(r.outcome, [])
        if len(shown) < FIRST_KEYS_SHOWN:
            shown.append(r.partition_key or "(initial)")
    return {o: first[o] for o in OUTCOMES if o in first}


#: What each materialization of a range carries: the range's outcome, the range and its counts. The rest
#: (winner, code, outbox counts, error, first keys or per-key table) is in the step's ``joblease step
#: outcome`` engine event, once per step; the materialization's own run is the step's run.
RANGE_MATERIALIZATION_KEYS = (META_OUTCOME, META_RUN_KEY, META_OUTCOMES)


def materialization_metadata(results: Sequence[LeasedResult]) -> dict[str, dg.MetadataValue]:
    """The metadata of the asset output's materializations: one key's every fact (as
    :func:`step_metadata`); for a range, Dagster repeats it on each key's materialization, so only the
    range's summary (:data:`RANGE_MATERIALIZATION_KEYS`, the same few hundred bytes whatever the range's
    size): a 10,000-key range would otherwise repeat its whole metadata 10,000 times (~17 MB). A skipped
    key's starts with :data:`META_SKIPPED` (:func:`skip_note`)."""
    meta = step_metadata(results, per_key_table=False)
    if len(results) > 1:
        return {k: v for k, v in meta.items() if k in RANGE_MATERIALIZATION_KEYS}
    note = skip_note(results[0]) if results else None
    if note is None:
        return meta
    # A skip's materialization (the winner ran elsewhere, an asset backfill counts it, or a downstream step
    # of the run needs the output) says so first: it is the partition page's latest materialization.
    return {META_SKIPPED: dg.MetadataValue.text(note), **meta}
