"""Run tags and metadata that make the lease outcome visible in the Dagster UI.

Dagster's Partitions view shows the *latest* run per partition, and a skipped duplicate is a successful
run there too; what tells the winner from the duplicates are these ``joblease/...`` tags (filterable in
the Runs list) and the op/asset output metadata.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from dagster_joblease import identity

__all__ = [
    "OUTBOX_ALREADY_PRESENT",
    "OUTBOX_INSERTED",
    "OUTBOX_NOT_ENQUEUED",
    "TAG_ATTEMPT",
    "TAG_CODE",
    "TAG_IDEMPOTENCY_KEY",
    "TAG_OUTBOX",
    "TAG_OUTCOME",
    "TAG_PARTITIONS",
    "LeasedResult",
    "output_metadata",
    "result_tags",
    "schedule_tags",
]

TAG_CODE = "joblease/code"
TAG_IDEMPOTENCY_KEY = "joblease/idempotency_key"
TAG_OUTCOME = "joblease/outcome"
TAG_ATTEMPT = "joblease/attempt"
TAG_OUTBOX = "joblease/outbox"
TAG_PARTITIONS = "joblease/partitions"

OUTBOX_INSERTED = "inserted"
OUTBOX_ALREADY_PRESENT = "already present"
OUTBOX_NOT_ENQUEUED = "not enqueued"

WON = "won"
RECLAIMED = "reclaimed"


@dataclasses.dataclass(frozen=True)
class LeasedResult:
    """What one logical run (one partition key, or the INITIAL run) did in this Dagster run.

    ``outcome`` is ``won``, ``reclaimed``, ``skipped: already succeeded`` or ``skipped: held by a live
    lease``; ``attempt`` is the lease's attempt (for a skip, the attempt that holds or finished it);
    ``outbox`` is ``inserted``, ``already present`` or ``not enqueued``.
    """

    code: str
    partition_key: str | None
    idempotency_key: str
    outcome: str
    attempt: int | None
    outbox: str
    result: Any = None

    @property
    def acquired(self) -> bool:
        return self.outcome in (WON, RECLAIMED)

    @property
    def skipped(self) -> bool:
        return not self.acquired


def schedule_tags(code: str, partition_key: str) -> dict[str, str]:
    """Tags a schedule puts on a run request: the lease code and the idempotency key it maps to."""
    job = identity.JobIdentity.schedule(code, partition_key)
    return {TAG_CODE: job.code, TAG_IDEMPOTENCY_KEY: job.idempotency_key}


def outbox_label(results: Sequence[bool]) -> str:
    """``inserted`` / ``already present`` for what ``enqueue_once`` returned; mixed lists are counted."""
    if not results:
        return OUTBOX_NOT_ENQUEUED
    inserted = sum(1 for r in results if r)
    if inserted == len(results):
        return OUTBOX_INSERTED
    if inserted == 0:
        return OUTBOX_ALREADY_PRESENT
    return f"{OUTBOX_INSERTED} {inserted}, {OUTBOX_ALREADY_PRESENT} {len(results) - inserted}"


def _summary(labels: Sequence[str]) -> str:
    counts = collections.Counter(labels)
    if len(counts) == 1:
        return labels[0]
    return ", ".join(f"{label} x{n}" for label, n in sorted(counts.items()))


def result_tags(results: Sequence[LeasedResult]) -> dict[str, str]:
    """Run tags for a run's results; per-key tags only when the run covered exactly one key."""
    if not results:
        return {}
    tags = {
        TAG_CODE: results[0].code,
        TAG_OUTCOME: _summary([r.outcome for r in results]),
        TAG_OUTBOX: _summary([r.outbox for r in results]),
    }
    if len(results) == 1:
        (only,) = results
        tags[TAG_IDEMPOTENCY_KEY] = only.idempotency_key
        tags[TAG_ATTEMPT] = str(only.attempt) if only.attempt is not None else "unknown"
    else:
        tags[TAG_PARTITIONS] = str(len(results))
    return tags


def _table(results: Sequence[LeasedResult]) -> str:
    lines = ["| partition | outcome | attempt | outbox | idempotency key |", "|---|---|---|---|---|"]
    lines += [
        f"| {r.partition_key or '(initial)'} | {r.outcome} | {r.attempt or ''} | {r.outbox} | "
        f"`{r.idempotency_key}` |"
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
    counts: Mapping[str, int] = collections.Counter("won" if r.acquired else "skipped" for r in results)
    meta["joblease/won"] = dg.MetadataValue.int(counts.get("won", 0))
    meta["joblease/skipped"] = dg.MetadataValue.int(counts.get("skipped", 0))
    if len(results) > 1:
        meta["joblease/results"] = dg.MetadataValue.md(_table(results))
    return meta
