"""A dispatcher's limit groups: one implementation of :class:`.kinds.GroupKind` per kind, picked for each
group when the dispatcher is built (as River's completer is picked):

* **unlimited** (:class:`.unlimited.UnlimitedGroups`, one object for every group without a limit here):
  the plain claim, one statement; outcomes recorded alone. A group another dispatcher limits (its
  registration in the group's row) is claimed under its lock by a :class:`.locked.LockedGroup` this
  object keeps for it;
* **locked** (:class:`.locked.LockedGroup`): a ``rate`` and/or ``max_in_flight`` under the group row's
  lock; outcomes and the refill in one transaction;
* **swapping** (:class:`.swapping.SwappingGroup`, PostgreSQL): ``max_in_flight`` alone; outcomes hand
  their slots on by a swap.

:class:`LimitGroups` is what the batch loop talks to: ``claim`` (the batch's claim: one transaction that
reads the groups' rows, dead-letters rows past their window, and runs each kind's claim, the groups in
their order, the order every transaction locks and writes group rows in) and ``complete`` (each finished
row to its group's kind). Every statement is a store module's: :mod:`dagster_joblease.storage.outbox`
and :mod:`dagster_joblease.storage.route_groups`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

import sqlalchemy as sa

from dagster_joblease import errors
from dagster_joblease.dispatch import capacity
from dagster_joblease.dispatch.claims import Finished
from dagster_joblease.dispatch.groups.kinds import GroupKind, Refill, Room, Shared, claim_failed, expire
from dagster_joblease.dispatch.groups.locked import LockedGroup
from dagster_joblease.dispatch.groups.swapping import SwappingGroup
from dagster_joblease.dispatch.groups.unlimited import UnlimitedGroups
from dagster_joblease.dispatch.recorder import DispatchReport
from dagster_joblease.storage import route_groups
from dagster_joblease.storage.engine import translate_errors

__all__ = [
    "GroupKind",
    "LimitGroups",
    "LockedGroup",
    "Refill",
    "Room",
    "Shared",
    "SwappingGroup",
    "UnlimitedGroups",
    "kind_of",
]

logger = logging.getLogger(__name__)


def kind_of(shared: Shared, group: str) -> GroupKind | None:
    """The implementation of ``group`` (None: unlimited here, :class:`UnlimitedGroups`'): swapping on
    PostgreSQL when max_in_flight alone limits it and no route of it sets a dedupe_window (the swap skips
    the dead-lettering of rows past their window) or counts connection failures (their writes would
    upgrade the swap's ``FOR SHARE`` of the group's row); locked otherwise."""
    mif, rate = shared.layout.group_limits[group]
    if mif is None and rate is None:
        return None
    routes = [shared.routes[t] for t in shared.topics_of(group)]
    if (
        shared.engine.dialect.name == "postgresql"
        and rate is None
        and all(r.dedupe_window_s is None and r.pause_after_failures is None for r in routes)
    ):
        return SwappingGroup(shared, group)
    return LockedGroup(shared, group)


class LimitGroups:
    """The batch loop's one interface to the limit groups (see the module's docstring)."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        names = sorted(shared.layout.group_topics)
        self.kinds: dict[str, GroupKind] = {}
        for name in names:
            kind = kind_of(shared, name)
            if kind is not None:
                self.kinds[name] = kind
        self.unlimited = UnlimitedGroups(shared, [n for n in names if n not in self.kinds])
        #: The groups claimed under their lock (limited) as of the last full claim.
        self.limited_seen: frozenset[str] = frozenset(self.kinds)
        self._names = names

    @property
    def mixed(self) -> bool:
        """Whether the routes have limited and unlimited groups (refills claim only the limited ones)."""
        return bool(self.limited_seen) and any(g not in self.limited_seen for g in self._names)

    def claim(
        self,
        token: str,
        room: Room,
        report: DispatchReport,
        *,
        limited_only: bool,
        busy: Collection[str] = (),
    ) -> Refill:
        """One claim transaction: the groups' rows read (``limited_only``: not, and only the groups
        limited at the last read are claimed), rows past their window dead-lettered, each kind's claim.
        A database error raises (the transaction rolled back: nothing was claimed)."""
        started = self.shared.timer.start()
        with translate_errors("claim outbox rows"), self.shared.engine.begin() as conn:
            refill = self._claim_in(conn, token, room, report, limited_only, busy, started)
        self.shared.timer.took()
        return refill

    def claim_during_batch(
        self, token: str, room: Room, report: DispatchReport, *, limited_only: bool, busy: Collection[str]
    ) -> Refill:
        """:meth:`claim` while a batch runs: a database error claims nothing, logged, instead of raising
        past the rows in flight and the outcomes still to record (the next turn looks again)."""
        try:
            return self.claim(token, room, report, limited_only=limited_only, busy=busy)
        except errors.StorageError as exc:
            return claim_failed(exc)

    def complete(
        self, token: str, finished: list[Finished], room: Room, report: DispatchReport, busy: Collection[str]
    ) -> Refill:
        """Each finished row to its group's kind, the groups in their order (rows claimed plainly first):
        outcomes recorded, freed capacity refilled within ``room`` (none: outcomes only). Whatever a
        statement does, every outcome is recorded or counted ``unrecorded``, and no claimed row is lost
        (see each kind's docstring)."""
        owners: dict[str, list[Finished]] = {}
        plain: list[Finished] = []
        for item in finished:
            group = item[0].group
            (plain if group is None else owners.setdefault(group, [])).append(item)
        refill = Refill()
        if plain:
            self.unlimited.complete(token, plain, room, report, busy)
        for group in sorted(owners):
            done = self._kind(group).complete(token, owners[group], room.less(len(refill.rows)), report, busy)
            refill = refill.add(done)
        return refill

    def refresh_pauses(self) -> None:
        """Re-read the groups' pauses (a cheap read, no transaction) so unstarted rows of a group another
        dispatcher paused are given back rather than sent; a database error changes nothing."""
        try:
            paused = route_groups.paused_now(self.shared.engine, self._names)
        except errors.StorageError:
            return
        self.shared.pauses.extend(paused, time.monotonic())

    def _kind(self, group: str) -> GroupKind:
        kind = self.kinds.get(group)
        return kind if kind is not None else self.unlimited.locked_for(group)

    def _claim_in(
        self,
        conn: sa.Connection,
        token: str,
        room: Room,
        report: DispatchReport,
        limited_only: bool,
        busy: Collection[str],
        started: float,
    ) -> Refill:
        # A refill claims only limited groups, whose locked row tells their pause: no read before.
        paused: set[str] = set()
        limited = set(self.limited_seen)
        if not limited_only:
            paused, limited = self._read_groups(conn, report, started)
        open_topics = {
            t
            for g in self._names
            if g not in paused and (g in limited or not limited_only)
            for t in self.shared.topics_of(g)
        }
        expire(self.shared, conn, open_topics, report)
        refill = Refill()
        if not limited_only:
            refill = self.unlimited.claim(conn, token, room, report, busy)
        for name in sorted(limited):
            left = room.less(len(refill.rows))
            if left.want <= 0:
                break
            refill = refill.add(self._kind(name).claim(conn, token, left, report, busy))
        return refill

    def _read_groups(
        self, conn: sa.Connection, report: DispatchReport, started: float
    ) -> tuple[set[str], set[str]]:
        """The routed groups' rows read: the paused ones (held off, noted in ``report``), and the ones to
        claim under their lock (limited here or by another dispatcher's registration)."""
        states = route_groups.read_states(conn, frozenset(self._names))
        paused = self.shared.pauses.note(self._names, states, report, started)
        registered = {name for name, state in states.items() if state.limited}
        limited = capacity.limited_groups(self._names, paused, self.shared.layout.group_limits, registered)
        self.unlimited.apply(paused, limited)
        self.limited_seen = frozenset(limited)
        return paused, limited
