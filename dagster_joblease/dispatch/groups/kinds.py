"""The interface every kind of limit group implements (:mod:`dagster_joblease.dispatch.groups` picks one
per group when the dispatcher is built), and what they share.

A kind owns its statements' calls, its slot accounting and the limits it applied, behind two calls:

* ``claim(conn, token, room, report, busy)``: claim rows in the caller's transaction (the batch's claim
  reads the groups' rows first and runs every kind's claim in one transaction, the groups in their
  order, the order every transaction locks and writes group rows in);
* ``complete(token, finished, room, report, busy) -> Refill``: record finished rows' outcomes, and the
  claim their freed capacity calls for (the *refill*), in as few statements as the kind allows.

Each implementation's docstring says what it does with finished outcomes and claimed rows when one of
its statements fails (a dropped connection included).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection
from typing import Any, Protocol

import sqlalchemy as sa

from dagster_joblease.dispatch import capacity, decisions
from dagster_joblease.dispatch.claims import Claimed, Finished
from dagster_joblease.dispatch.pauses import ClaimTimer, Pauses
from dagster_joblease.dispatch.recorder import MAX_REPORT_ROWS, DispatchReport, Recorder, RowOutcome
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.storage import outbox as store

__all__ = ["GroupKind", "Refill", "Room", "Shared", "absorb", "expire"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Refill:
    """What a claim took: its rows (sorted by id), and per limit group whose due rows had to wait for
    capacity, the seconds worth waiting before looking again."""

    rows: list[Claimed] = dataclasses.field(default_factory=list)
    waits: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, other: Refill) -> Refill:
        """Both claims' rows (sorted) and waits."""
        return Refill(sorted([*self.rows, *other.rows], key=lambda r: r.id), {**self.waits, **other.waits})


@dataclasses.dataclass(frozen=True)
class Room:
    """How many rows a claim may take: the batch's ``budget`` left and the ``idle`` workers."""

    budget: int
    idle: int

    @property
    def want(self) -> int:
        return max(0, min(self.budget, self.idle))

    def less(self, taken: int) -> Room:
        """The room left once ``taken`` rows are claimed."""
        return Room(self.budget - taken, self.idle - taken)


@dataclasses.dataclass(frozen=True)
class Shared:
    """What every group of one dispatcher shares: its engine, routes and their layout, claim length, the
    recorder of outcomes, the local pauses and the claims' timer."""

    engine: sa.Engine
    routes: dict[str, Route]
    layout: capacity.Layout
    claim_ms: int
    recorder: Recorder
    pauses: Pauses
    timer: ClaimTimer
    async_swap_commit: bool

    def topics_of(self, group: str) -> tuple[str, ...]:
        return self.layout.group_topics[group]


class GroupKind(Protocol):
    """One kind of limit group (see the module's docstring)."""

    def claim(
        self, conn: sa.Connection, token: str, room: Room, report: DispatchReport, busy: Collection[str]
    ) -> Refill:
        """Claim rows of this kind's groups in ``conn``'s transaction, within ``room``."""
        ...

    def complete(
        self, token: str, finished: list[Finished], room: Room, report: DispatchReport, busy: Collection[str]
    ) -> Refill:
        """Record ``finished`` rows' outcomes into ``report`` and claim what their freed capacity calls
        for, within ``room`` (none: only record)."""
        ...


def claim_failed(exc: Exception) -> Refill:
    """A claim made while a batch runs failed: logged, nothing claimed; the rows in flight go on and the
    next turn looks again."""
    logger.warning(
        "a claim during the batch failed; the rows in flight go on: %s",
        exc,
        extra={"action": "dispatch_claim_failed"},
    )
    return Refill()


def absorb(report: DispatchReport, sub: DispatchReport) -> None:
    """Count what a committed claim reported (pauses seen, rows dead-lettered) into the batch's report."""
    report.paused.update(sub.paused)
    report.dead += sub.dead
    report.expired += sub.expired
    report.rows.extend(sub.rows)


def expire(shared: Shared, conn: sa.Connection, topics: Collection[str], report: DispatchReport) -> None:
    """Dead-letter due rows of ``topics`` whose route's dedupe_window has passed (one UPDATE per window
    setting; nothing at all when no route sets one)."""
    for (window_ms, margin_ms), window_topics in shared.layout.windows.items():
        scoped = [t for t in window_topics if t in topics]
        if not scoped:
            continue
        reason = decisions.dedupe_window_reason(window_ms / 1000)
        for r in store.expire_past_window(
            conn, topics=scoped, window_ms=window_ms, margin_ms=margin_ms, reason=reason
        ):
            _expired(r, window_ms, report)


def _expired(r: Any, window_ms: int, report: DispatchReport) -> None:
    report.dead += 1
    report.expired += 1
    reason = f"dedupe_window ({window_ms / 1000:g} s) passed since the first attempt"
    if len(report.rows) < MAX_REPORT_ROWS:
        report.rows.append(RowOutcome(r.id, r.idempotency_key, r.topic, "dead", r.last_status, reason))
    logger.warning(
        "outbox row %d (key %s, topic %s) is DEAD: its first attempt is older than the route's "
        "dedupe_window (%g s); the downstream may have forgotten the key, so it is not sent "
        "again. Reconcile the effect by hand; `joblease outbox requeue %d` resends it with a "
        "fresh window",
        r.id,
        r.idempotency_key,
        r.topic,
        window_ms / 1000,
        r.id,
        extra={"action": "outbox_expired"},
    )
