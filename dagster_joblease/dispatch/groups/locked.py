"""A limit group claimed under its row's lock: a ``rate`` (admissions with start windows) and/or a
``max_in_flight`` (counted by the claim statement itself when it is the only limit), and any group
another dispatcher limits (its registration in the group's row)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Collection
from typing import Any

import sqlalchemy as sa

from dagster_joblease import errors, limits
from dagster_joblease.dispatch import capacity
from dagster_joblease.dispatch.capacity import APPLIED_TRUST_S, SLOT_POLL_S
from dagster_joblease.dispatch.claims import Claimed, Finished, StartWindow, from_row
from dagster_joblease.dispatch.groups.kinds import Refill, Room, Shared, absorb, claim_failed, expire
from dagster_joblease.dispatch.recorder import DispatchReport
from dagster_joblease.storage import outbox as store
from dagster_joblease.storage import route_groups
from dagster_joblease.storage.engine import translate_errors

__all__ = ["LockedGroup"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Admission:
    """A rate's admissions (``rows``) at database time ``now``, read between local times ``asked`` and
    ``answered``."""

    rows: limits.RateAdmission
    now: dt.datetime
    asked: float
    answered: float


def _as_stored(value: dt.datetime, conn: sa.Connection) -> dt.datetime:
    """A UTC datetime as the backend stores it (SQLite keeps naive UTC text)."""
    return value.replace(tzinfo=None) if conn.dialect.name == "sqlite" else value


class LockedGroup:
    """One limit group claimed under its row lock (see the module's docstring).

    ``claim``: a lock-free look at the group's slots first while the group is known to be full (its
    max_in_flight alone, read under the lock less than :data:`APPLIED_TRUST_S` ago), then the group's
    row locked, its limits applied (the smallest any dispatcher registered; this one's registration
    refreshed), the rows claimed and the row updated.

    ``complete``: the outcomes' writes, the group's row lock and the refill's claim in one transaction.

    When a statement fails: ``claim`` raises and its caller's transaction rolls back (nothing claimed);
    ``complete``'s transaction rolls back (nothing claimed) and the outcomes are written again alone, on
    a fresh connection, with the recorder's retries; :meth:`claim_alone` claims nothing and logs.
    """

    def __init__(self, shared: Shared, group: str) -> None:
        self.shared = shared
        self.group = group
        self.topics = shared.topics_of(group)
        #: (max_in_flight, rate) applied at this dispatcher's last locked claim, trusted until.
        self.applied: tuple[int | None, int | None, float] | None = None
        self._mismatch_logged: set[tuple[str, int | None]] = set()

    # -- the interface --------------------------------------------------------------------------------

    def claim(
        self, conn: sa.Connection, token: str, room: Room, report: DispatchReport, busy: Collection[str]
    ) -> Refill:
        """Claim up to ``room.want`` rows under the group's row lock, in ``conn``'s transaction (the caller
        dead-lettered rows past their window); a wait hint when due rows had to stay behind for capacity
        (``busy``: groups this batch has requests of in flight, whose completions claim again)."""
        rows, hint = self._claim(conn, token, room.want, report, self.group in busy)
        return Refill(rows, {} if hint is None else {self.group: hint})

    def complete(
        self, token: str, finished: list[Finished], room: Room, report: DispatchReport, busy: Collection[str]
    ) -> Refill:
        """Record ``finished`` (rows of this group) and refill the slots they freed: one transaction, one
        commit (the slots never wait for another dispatcher's poll). No room: the outcomes alone."""
        recorder = self.shared.recorder
        if room.want <= 0:
            recorder.record(token, finished, report)
            return Refill()
        sub = DispatchReport()
        self.shared.timer.start()
        try:
            with (
                translate_errors("record outcomes and refill their slots"),
                self.shared.engine.begin() as conn,
            ):
                matched = recorder.write(conn, token, finished)
                expire(self.shared, conn, self.topics, sub)
                refill = self.claim(conn, token, room, sub, busy)
        except errors.StorageError as exc:
            logger.info(
                "a refill failed, recording the outcomes alone: %s",
                exc,
                extra={"action": "outbox_refill_retry"},
            )
            recorder.record(token, finished, report)
            return Refill(waits={self.group: SLOT_POLL_S})  # nothing claimed: look again soon
        self.shared.timer.took()
        recorder.tally(finished, matched, report)
        absorb(report, sub)
        return refill

    def claim_alone(self, token: str, room: Room, report: DispatchReport, busy: Collection[str]) -> Refill:
        """:meth:`claim` in a transaction of its own; a database error claims nothing (logged): the rows
        in flight go on, the next turn looks again."""
        sub = DispatchReport()
        self.shared.timer.start()
        try:
            with translate_errors("claim outbox rows"), self.shared.engine.begin() as conn:
                expire(self.shared, conn, self.topics, sub)
                refill = self.claim(conn, token, room, sub, busy)
        except errors.StorageError as exc:
            return claim_failed(exc)
        self.shared.timer.took()
        absorb(report, sub)
        return refill

    def trust(self, max_in_flight: int) -> None:
        """A swap read the group's row: its max_in_flight alone is in force (trusted for the lock-free
        look)."""
        self.applied = (max_in_flight, None, time.monotonic() + APPLIED_TRUST_S)

    @property
    def registered_rate(self) -> int | None:
        """The rate applied at the last locked claim (None: none, or not known yet)."""
        return None if self.applied is None else self.applied[1]

    # -- one locked claim -----------------------------------------------------------------------------

    def _claim(
        self, conn: sa.Connection, token: str, want: int, report: DispatchReport, busy: bool
    ) -> tuple[list[Claimed], float | None]:
        worth, hint = self._worth_locking(conn)
        if not worth:
            return [], hint
        state = route_groups.lock_group(conn, self.group)
        local_now = time.monotonic()
        if state.paused:
            self.shared.pauses.hold_off(self.group, state, report, local_now)
            return [], None
        mif, rate, values = self._applied_limits(state, local_now)
        size, admission = self._size(conn, state, want, (mif, rate))
        rows: list[Claimed] = []
        if size is None or size > 0:
            slots = mif if size is None else None  # None: the statement counts no slots
            rows = self._take(conn, token, want if size is None else size, slots, admission)
            if admission is not None and rows:
                next_ms = admission.rows.next_after(len(rows))
                values["rate_next_at"] = _as_stored(admission.now + dt.timedelta(milliseconds=next_ms), conn)
        route_groups.update_group(conn, self.group, values)
        return rows, self._hint(conn, (want, len(rows), size), admission, busy)

    def _worth_locking(self, conn: sa.Connection) -> tuple[bool, float | None]:
        """What can be told without the row lock: ``(True, None)``, take the lock and claim; else
        ``(False, the wait hint)``: the group is held off locally (a downstream's pause, perhaps not
        committed yet: no hint) or known to be full (a short poll while due rows wait)."""
        local_now = time.monotonic()
        if self.shared.pauses.holds(self.group, local_now):
            return False, None
        trusted = capacity.trusted_max_in_flight(self.applied, local_now)
        if trusted is None:
            return True, None
        # Only max_in_flight, its value known a moment ago: a plain read tells whether a slot is free, so
        # a dispatcher waiting for one does not queue for the group's row lock (which the holders' refills
        # and a pause being written need) only to learn that the group is full.
        in_flight, due = store.look_at_slots(conn, self.group, self.topics)
        if in_flight < trusted:
            return True, None
        return False, (SLOT_POLL_S if due else None)

    def _hint(
        self,
        conn: sa.Connection,
        counts: tuple[int, int, int | None],
        admission: _Admission | None,
        busy: bool,
    ) -> float | None:
        """The wait hint of a locked claim that took fewer rows than wanted because of the group's limit
        (``counts``: wanted, taken, its size), if due rows stayed behind (``busy``: this batch has requests
        of the group in flight, whose completions claim again; the hint only says "look again", and costs
        no read); else None."""
        want, got, size = counts
        rate_rows = admission.rows if admission is not None else None
        if capacity.held_back(want, got, size, rate_rows) and (busy or store.any_due(conn, self.topics)):
            return capacity.wait_hint(rate_rows)
        return None

    def _size(
        self, conn: sa.Connection, state: route_groups.GroupState, want: int, applied: capacity.Limits
    ) -> tuple[int | None, _Admission | None]:
        """How many rows a locked claim takes (None: as many as its max_in_flight leaves, counted by the
        claim statement) and its rate's admissions, under the ``applied`` limits."""
        mif, rate = applied
        in_flight = store.count_in_flight(conn, self.group) if mif is not None and rate is not None else None
        size = capacity.claim_size(want, mif, rate, in_flight)
        if rate is None or size is None or size <= 0:
            return size, None
        admission = self._admit(conn, rate, state, size)
        return admission.rows.count, admission

    def _admit(self, conn: sa.Connection, rate: int, state: route_groups.GroupState, size: int) -> _Admission:
        """The rate's admissions for up to ``size`` rows. The database clock is read once the group is
        locked, bracketed by local times: an admission's true local moment lies in [asked, answered] + its
        offset (see capacity.start_windows), so every dispatcher's requests start within RATE_LATE_S of
        their admissions whatever a loaded machine does to this round trip."""
        asked = time.monotonic()
        now = route_groups.database_now(conn)
        answered = time.monotonic()
        lead_ms = 2000 * self.shared.timer.seconds
        rows = limits.admit_rate(rate, state.rate_next_at, now, size, lead_ms=lead_ms)
        return _Admission(rows, now, asked, answered)

    def _take(
        self, conn: sa.Connection, token: str, want: int, slots: int | None, admission: _Admission | None
    ) -> list[Claimed]:
        """Claim up to ``want`` rows (``slots`` given: and no more than that max_in_flight leaves, counted
        by the statement), each with its rate admission's window."""
        claimed = store.claim_for_group(
            conn,
            group=self.group,
            topics=self.topics,
            claim_ms=self.shared.claim_ms,
            token=token,
            want=want,
            max_in_flight=slots,
        )
        windows: list[tuple[float | None, float | None]] = [(None, None)] * len(claimed)
        if admission is not None:
            windows = capacity.start_windows(
                admission.rows.offsets_ms, len(claimed), admission.asked, admission.answered
            )
        started = self.shared.timer.started
        return [
            from_row(r, group=self.group, claimed_at=started, window=StartWindow(*window))
            for r, window in zip(claimed, windows, strict=True)
        ]

    def _applied_limits(
        self, state: route_groups.GroupState, local_now: float
    ) -> tuple[int | None, int | None, dict[str, Any]]:
        """The max_in_flight and rate in force (the group's row ``state`` read under the lock), and the
        registrations this dispatcher writes to the row (its own value in force, not fresh)."""
        mine_mif, mine_rate = self.shared.layout.group_limits[self.group]
        mif = limits.applied_limit(mine_mif, state.max_in_flight, state.max_in_flight_live)
        rate = limits.applied_limit(mine_rate, state.rate, state.rate_live)
        self.applied = (mif.value, rate.value, local_now + APPLIED_TRUST_S)
        values: dict[str, Any] = {}
        for name, applied, mine in (("max_in_flight", mif, mine_mif), ("rate", rate, mine_rate)):
            if applied.register and not state.registration_fresh(name, applied.value):
                values[name] = applied.value
                values[f"{name}_until"] = route_groups.registration_until()
            if applied.mismatch:
                self._log_mismatch(name, mine, applied.value)
        return mif.value, rate.value, values

    def _log_mismatch(self, name: str, mine: int | None, theirs: int | None) -> None:
        if (name, mine) in self._mismatch_logged:
            return
        self._mismatch_logged.add((name, mine))
        logger.warning(
            "limit group %s: this dispatcher configures %s=%s, another dispatcher %s; the smallest applies",
            self.group,
            name,
            mine,
            theirs,
            extra={"action": "limit_mismatch"},
        )
