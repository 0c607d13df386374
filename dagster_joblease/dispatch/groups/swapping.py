"""A limit group limited by ``max_in_flight`` alone (PostgreSQL, no ``dedupe_window``, no
``pause_after_failures`` on its routes): finished rows' slots are handed on to due rows by a *swap*,
without the group row's exclusive lock (:func:`dagster_joblease.storage.outbox.swap`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection

import sqlalchemy as sa

from dagster_joblease import errors
from dagster_joblease.dispatch import policy
from dagster_joblease.dispatch.capacity import SLOT_POLL_S
from dagster_joblease.dispatch.claims import Finished, from_row
from dagster_joblease.dispatch.groups.kinds import Refill, Room, Shared
from dagster_joblease.dispatch.groups.locked import LockedGroup
from dagster_joblease.dispatch.recorder import DispatchReport
from dagster_joblease.storage import outbox as store
from dagster_joblease.storage import route_groups
from dagster_joblease.storage.engine import translate_errors

__all__ = ["SwappingGroup"]

logger = logging.getLogger(__name__)


class SwappingGroup:
    """One group limited by max_in_flight alone (see the module's docstring).

    ``claim``: the locked claim (:class:`LockedGroup`, whose applied limits this group shares).

    ``complete``: when every finished row was sent with one status code, one autocommit statement records
    them SENT and hands their slots on (no BEGIN, no COMMIT, no row lock); otherwise one transaction swaps
    first (reading the group's row ``FOR SHARE``), then writes the outcomes. Slots not handed on, and room
    the group has beside them, are claimed by the locked claim afterwards, in a transaction of its own (an
    exclusive lock after ``FOR SHARE`` could deadlock with another swap). Rows that keep their slot (a
    timeout's grace), a group held off locally or a registered rate, a pause asked for, or no room: the
    locked group's completion instead.

    When a statement fails: the autocommit swap wrote nothing, and the outcomes are recorded by the
    locked completion; the swap's transaction rolls back (nothing claimed), and the outcomes are written
    again alone on a fresh connection; the locked claim after a swap claims nothing (logged) and the rows
    the swap claimed are kept. Not covered: a connection dropped after an autocommit swap committed but
    before its answer arrived (the rows it claimed wait for their claims to expire; the outcomes then
    match nothing and count as lost claims).
    """

    def __init__(self, shared: Shared, group: str) -> None:
        self.shared = shared
        self.group = group
        self.locked = LockedGroup(shared, group)
        mine = shared.layout.group_limits[group][0]
        assert mine is not None, "a swapping group has a max_in_flight"
        shape = store.SwapShape(
            group=group,
            topics=shared.topics_of(group),
            max_in_flight=mine,
            claim_ms=shared.claim_ms,
            fresh_ms=route_groups.FRESH_MS,
            record_sent=False,
        )
        #: The swap inside the outcomes' transaction, and the one that records SENT rows itself (alone).
        alone = dataclasses.replace(shape, record_sent=True, async_commit=shared.async_swap_commit)
        self._shapes = (shape, alone)

    def claim(
        self, conn: sa.Connection, token: str, room: Room, report: DispatchReport, busy: Collection[str]
    ) -> Refill:
        """The locked claim (:meth:`LockedGroup.claim`)."""
        return self.locked.claim(conn, token, room, report, busy)

    def complete(
        self, token: str, finished: list[Finished], room: Room, report: DispatchReport, busy: Collection[str]
    ) -> Refill:
        """Record ``finished`` (rows of this group) and hand their slots on (see the class docstring)."""
        ids = self._handed(finished, room)
        if not ids:
            return self.locked.complete(token, finished, room, report, busy)
        sent = self._all_sent(finished)
        if sent is not None and len(ids) == len(finished):
            refill = self._swap_alone(token, finished, ids, sent, room, report, busy)
            if refill is not None:
                return refill
            return self.locked.complete(token, finished, room, report, busy)
        return self._swap_with_outcomes(token, finished, ids, room, report, busy)

    def _handed(self, finished: list[Finished], room: Room) -> list[int]:
        """The finished rows whose slots a swap may hand on: rows with an outcome (a claim given back
        undelivered is not among them) that do not keep their slot for a grace; none when the group is
        held off, another dispatcher registered a rate, an outcome asks for a pause (its write would
        upgrade the swap's ``FOR SHARE``), or there is no room."""
        if room.want <= 0 or self.locked.registered_rate is not None:
            return []
        if self.shared.pauses.holds(self.group, time.monotonic()):
            return []
        if any(d is not None and d.pause_ms for _, d in finished):
            return []
        hold_ms = self.shared.recorder.hold_ms
        return [row.id for row, d in finished if d is not None and not hold_ms(row, d)]

    @staticmethod
    def _all_sent(finished: list[Finished]) -> tuple[int | None] | None:
        """``(status code,)`` when every finished row was sent with that one status code; else None."""
        codes = set()
        for _, d in finished:
            if d is None or d.outcome is not policy.Outcome.SENT:
                return None
            codes.add(d.status_code)
        return (codes.pop(),) if len(codes) == 1 else None

    def _swap_alone(
        self,
        token: str,
        finished: list[Finished],
        ids: list[int],
        sent: tuple[int | None],
        room: Room,
        report: DispatchReport,
        busy: Collection[str],
    ) -> Refill | None:
        """The usual completion as one autocommit statement; None: it failed (nothing was written)."""
        started = self.shared.timer.start()
        try:
            with (
                translate_errors("record outcomes and hand on their slots"),
                self.shared.engine.connect() as conn,
            ):
                swapped = store.swap(
                    conn.execution_options(isolation_level="AUTOCOMMIT"),
                    self._shapes[1],
                    ids=ids,
                    token=token,
                    want=min(len(ids), room.want),
                    status_code=sent[0],
                )
        except errors.StorageError as exc:
            logger.info(
                "a swap failed, recording the outcomes as usual: %s",
                exc,
                extra={"action": "outbox_swap_retry"},
            )
            return None
        self.shared.timer.took()
        assert len(swapped.claimed) <= len(swapped.done), "a swap claimed more rows than it recorded"
        self.shared.recorder.tally(finished, swapped.done, report)
        return self._grow(token, swapped, len(ids), started, room, report, busy)

    def _swap_with_outcomes(
        self,
        token: str,
        finished: list[Finished],
        ids: list[int],
        room: Room,
        report: DispatchReport,
        busy: Collection[str],
    ) -> Refill:
        """The swap, then the outcomes' writes, in one transaction (the swap reads the finished rows'
        claims, so it runs first); a failure rolls both back and the outcomes are written again alone."""
        recorder = self.shared.recorder
        started = self.shared.timer.start()
        try:
            with (
                translate_errors("record outcomes and hand on their slots"),
                self.shared.engine.begin() as conn,
            ):
                swapped = store.swap(
                    conn, self._shapes[0], ids=ids, token=token, want=min(len(ids), room.want)
                )
                matched = recorder.write(conn, token, finished)
                # Never more slots handed on than finished rows whose outcomes were recorded now (a claim
                # lost between the swap and the outcome's write would otherwise leave its slot counted
                # twice): roll the whole transaction back, the outcomes are retried alone.
                if len(swapped.claimed) > len(matched.intersection(ids)):
                    raise errors.StorageError(
                        f"limit group {self.group}: a swap outran its recorded outcomes"
                    )
        except errors.StorageError as exc:
            logger.info(
                "a swap failed, recording the outcomes alone: %s", exc, extra={"action": "outbox_swap_retry"}
            )
            recorder.record(token, finished, report)
            return Refill(waits={self.group: SLOT_POLL_S})  # nothing claimed: look again soon
        self.shared.timer.took()
        recorder.tally(finished, matched, report)
        return self._grow(token, swapped, len(ids), started, room, report, busy)

    def _grow(
        self,
        token: str,
        swapped: store.SwapResult,
        handed: int,
        started: float,
        room: Room,
        report: DispatchReport,
        busy: Collection[str],
    ) -> Refill:
        """The rows a swap claimed, and the locked claim of slots it could not hand on or room the group
        has beside them (a transaction of its own); a full group is looked at again soon."""
        taken = [from_row(r, group=self.group, claimed_at=started) for r in swapped.claimed]
        refill = Refill(sorted(taken, key=lambda r: r.id))
        if swapped.max_in_flight is None:
            room_beside = 1  # the row did not allow a swap (paused, a rate, a stale registration): look
        else:
            self.locked.trust(swapped.max_in_flight)
            room_beside = swapped.max_in_flight - swapped.others - len(taken)
        if len(taken) < handed or room_beside > 0:
            left = room.less(len(taken))
            if left.want > 0:
                refill = refill.add(self.locked.claim_alone(token, left, report, busy))
        elif taken:
            refill.waits[self.group] = SLOT_POLL_S  # full again: its next completion (or a poll) claims
        return refill
