"""Every limit group without a limit here: claimed plainly, one statement for all of them."""

from __future__ import annotations

from collections.abc import Collection

import sqlalchemy as sa

from dagster_joblease.dispatch.claims import Finished, from_row
from dagster_joblease.dispatch.groups.kinds import Refill, Room, Shared
from dagster_joblease.dispatch.groups.locked import LockedGroup
from dagster_joblease.dispatch.recorder import DispatchReport
from dagster_joblease.storage import outbox as store

__all__ = ["UnlimitedGroups"]


class UnlimitedGroups:
    """Every group without a limit here (see the module's docstring).

    ``claim``: one statement, due rows of the open groups' topics up to the batch's budget (no lock).
    ``complete``: the outcomes alone, in one transaction; nothing to refill (the batch claims again).

    When a statement fails: the claim raises and its caller's transaction rolls back (nothing claimed);
    the outcomes' write is retried on a fresh connection a few times, then counted ``unrecorded`` (their
    claims expire and the rows are sent again, deduplicated by their keys).
    """

    def __init__(self, shared: Shared, groups: Collection[str]) -> None:
        self.shared = shared
        self.groups = frozenset(groups)
        #: The topics claimed now: those of the groups not paused and not limited by another dispatcher.
        self.open: list[str] = sorted(t for g in self.groups for t in shared.topics_of(g))
        #: Groups another dispatcher limits, claimed under their lock.
        self._locked: dict[str, LockedGroup] = {}

    def apply(self, paused: Collection[str], registered: Collection[str]) -> None:
        """The groups' rows as just read: ``paused`` ones and ones another dispatcher limits (claimed
        under their lock by :meth:`locked_for`) are not claimed plainly."""
        closed = set(paused) | set(registered)
        self.open = sorted(t for g in self.groups - closed for t in self.shared.topics_of(g))

    def locked_for(self, group: str) -> LockedGroup:
        """The locked claim of ``group``, one of these limited by another dispatcher."""
        if group not in self._locked:
            self._locked[group] = LockedGroup(self.shared, group)
        return self._locked[group]

    def claim(
        self, conn: sa.Connection, token: str, room: Room, report: DispatchReport, busy: Collection[str]
    ) -> Refill:
        """Claim up to ``room.budget`` due rows of the open topics (one statement)."""
        if not self.open or room.budget <= 0:
            return Refill()
        rows = store.claim_due(
            conn, token=token, limit=room.budget, claim_ms=self.shared.claim_ms, topics=self.open
        )
        started = self.shared.timer.started
        return Refill([from_row(r, claimed_at=started) for r in rows])

    def complete(
        self, token: str, finished: list[Finished], room: Room, report: DispatchReport, busy: Collection[str]
    ) -> Refill:
        """Record ``finished`` (rows claimed plainly); nothing is refilled here."""
        self.shared.recorder.record(token, finished, report)
        return Refill()
