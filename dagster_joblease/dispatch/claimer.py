"""The dispatcher's claims: which due rows it takes and when, as IO around :mod:`capacity`'s decisions.

Three statements put rows in flight (all :mod:`dagster_joblease.storage.outbox`'s):

* the **plain claim** (:func:`~dagster_joblease.storage.outbox.claim_due`): due rows of the routes of
  unlimited groups, up to the batch's budget, in the transaction that first reads the groups' state;
* a limited group's **locked claim** (:func:`~dagster_joblease.storage.outbox.claim_for_group`) under
  the group's row lock: as far as its ``max_in_flight`` (counted by the statement itself when it is the
  only limit) and its ``rate`` (admissions with start windows) allow, and no further than idle workers;
  a lock-free look at the group's slots skips it while the group is known to be full;
* the **swap** (:func:`~dagster_joblease.storage.outbox.swap`, PostgreSQL, groups limited by
  ``max_in_flight`` alone): finished rows' slots handed on to due rows without the exclusive lock, as
  one autocommit statement that also records them SENT (:meth:`Claimer._swap_alone`) or inside the
  transaction that records mixed outcomes (:meth:`Claimer._refill_claim`). Room beside the handed-on
  slots is claimed by the locked claim afterwards, in a transaction of its own.

Group rows are locked in the groups' order (sorted), and a transaction that read some ``FOR SHARE`` (a
swap) takes no exclusive lock after them. When a statement fails (a dropped connection included):

* a claim's transaction rolls back, so nothing was claimed; the batch's first claim raises (``run()``
  logs it and tries again), a claim while the batch runs (:meth:`Claimer._claim_during_batch`) claims
  nothing and the batch goes on with the rows in flight;
* the swap alone (autocommit) wrote nothing: the outcomes are recorded as usual, by the recorder;
* a swap or claim inside the outcomes' transaction rolls the outcomes back with it: the recorder writes
  them again alone, on a fresh connection (:mod:`~dagster_joblease.dispatch.recorder`), and the batch
  claims on its own;
* the claims after a swap's hand-over keep the rows the swap already claimed.

Not covered: a connection dropped after an autocommit swap committed but before its answer arrived (the
rows it claimed wait for their claims to expire; the outcomes then match nothing and count as lost claims).

:class:`Claimer` is the claim half of :class:`~dagster_joblease.dispatch.dispatcher.Dispatcher` (a base
class sharing its state: the routes' groups, the local pauses, the limits applied at the last locked
claim); the attributes it uses are declared below.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import logging
import math
import time
from collections.abc import Collection, Mapping
from concurrent.futures import Future
from typing import Any

import sqlalchemy as sa

from dagster_joblease import errors, limits
from dagster_joblease.dispatch import capacity, decisions, policy
from dagster_joblease.dispatch.capacity import APPLIED_TRUST_S, GROW_NOW, SLOT_POLL_S
from dagster_joblease.dispatch.claims import Claimed, Finished, from_row
from dagster_joblease.dispatch.recorder import (
    MAX_REPORT_ROWS,
    DispatchReport,
    MergedRefill,
    Recorder,
    RowOutcome,
)
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.storage import outbox as store
from dagster_joblease.storage import route_groups
from dagster_joblease.storage.engine import translate_errors

__all__ = ["Claimer"]

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


class Claimer:
    """The claim half of the dispatcher (see the module's docstring)."""

    # The dispatcher's state the claims read and write (set by Dispatcher.__init__).
    engine: sa.Engine
    routes: dict[str, Route]
    topics: frozenset[str]
    groups: frozenset[str]
    claim_ms: int
    async_swap_commit: bool
    _group_of: dict[str, str]
    _group_topics: dict[str, tuple[str, ...]]
    _group_limits: dict[str, tuple[int | None, int | None]]
    _windows: dict[tuple[int, int], list[str]]
    _recorder: Recorder
    #: group → local monotonic time until which this dispatcher holds the group off (a pause).
    _local_pause: dict[str, float]
    #: group → when this dispatcher's own write of a pause finished (inf while it is being written).
    _pause_settled: dict[str, float]
    #: group → (max_in_flight, rate) applied at this dispatcher's last locked claim, trusted until.
    _applied: dict[str, tuple[int | None, int | None, float]]
    #: The groups claimed under their lock (limited) as of the last full claim.
    _limited_seen: frozenset[str]
    _mismatch_logged: set[tuple[str, str, int | None]]
    _statements_cache: dict[tuple[str, str, int | None], sa.Executable]
    #: A claim's smoothed time to its commit, and when the current one started (local monotonic).
    _claim_s: float
    _claim_started: float

    def _record(
        self, token: str, finished: list[Finished], report: DispatchReport, then: MergedRefill | None = None
    ) -> tuple[list[Claimed], dict[str, float], DispatchReport] | None:
        """Store ``finished`` rows' outcomes (see :meth:`Recorder.record`)."""
        return self._recorder.record(token, finished, report, then)

    def _record_and_refill(
        self,
        token: str,
        finished: list[Finished],
        budget: int,
        free: int,
        report: DispatchReport,
        inflight: Mapping[Future[Any], Claimed],
    ) -> tuple[list[Claimed], dict[str, float]] | None:
        """The outcomes that freed slots and the claim that refills them: one transaction, one commit (the
        slots never wait for another dispatcher's poll); in the usual case one statement that hands the
        slots on (a swap), else one transaction. None: the outcomes were recorded without a refill."""
        busy_groups = self._busy_groups(inflight)
        refill = self._swap_alone(token, finished, budget, free, report, busy_groups)
        if refill is not None:
            return refill
        then = self._refill_claim(token, budget, free, busy_groups, self._handoffs(finished))
        merged = self._record(token, finished, report, then=then)
        if merged is None:
            return None
        more, blocked, sub = merged
        self._claim_took()
        self._absorb(report, sub)
        grow = {name for name, hint in blocked.items() if hint == GROW_NOW}
        blocked = {n: h for n, h in blocked.items() if n not in grow}
        left, idle = budget - len(more), free - len(more)
        if grow and left > 0 and idle > 0:
            # Room beside the swapped slots: claimed under the lock, a transaction of its own (the swap's
            # held the group row FOR SHARE).
            extra, blocked_more = self._claim_during_batch(
                token, left, idle, report, limited_only=True, busy=busy_groups
            )
            more, blocked = [*more, *extra], {**blocked, **blocked_more}
        return more, blocked

    @staticmethod
    def _busy_groups(inflight: Mapping[Future[Any], Claimed]) -> set[str]:
        return {r.group for r in inflight.values() if r.group is not None}

    def _handoffs(self, finished: list[Finished]) -> dict[str, list[int]]:
        """Per limit group, the finished rows whose slots a swap may hand on (see :meth:`_swap`): rows with
        an outcome (a claim given back undelivered is not among them) of groups limited by
        ``max_in_flight`` alone, on PostgreSQL, and with no ``dedupe_window`` on the group's routes (the
        swap skips the refill's dead-lettering of rows past their window)."""
        if self.engine.dialect.name != "postgresql":
            return {}
        handed: dict[str, list[int]] = {}
        now = time.monotonic()
        for row, decision in finished:
            group = row.group
            if group is None or decision is None or self._local_pause.get(group, 0.0) > now:
                continue
            if self._recorder.hold_ms(row, decision):
                continue  # a timed-out request keeps its slot for a grace: nothing to hand on
            known = self._applied.get(group)
            if capacity.hands_on(
                self._group_limits[group],
                known[1] if known is not None else None,
                any(self.routes[t].dedupe_window_s is not None for t in self._group_topics[group]),
            ):
                handed.setdefault(group, []).append(row.id)
        return handed

    def _swap_alone(
        self,
        token: str,
        finished: list[Finished],
        budget: int,
        free: int,
        report: DispatchReport,
        busy: Collection[str],
    ) -> tuple[list[Claimed], dict[str, float]] | None:
        """The usual completion of a full group as one autocommit statement (PostgreSQL): ``finished`` are
        rows of one group limited by max_in_flight alone, all sent with one status code; they are marked
        SENT and their slots handed on (see :func:`store.swap`: the same bounds) in one round trip, no
        BEGIN, no COMMIT, no group row lock. Slots it could not hand on, and room the group has beside
        them, are claimed after it by the usual refill. None: not applicable, or the statement failed (it is
        atomic: nothing was written, the caller records the outcomes as usual)."""
        alone = self._swap_alone_case(finished)
        if alone is None:
            return None
        group, ids, status_code = alone
        params = {"ids": ids, "token": token, "status_code": status_code, "want": min(len(ids), budget, free)}
        started = self._claim_started = time.monotonic()
        try:
            with translate_errors("record outcomes and hand on their slots"), self.engine.connect() as conn:
                result = conn.execution_options(isolation_level="AUTOCOMMIT").execute(
                    self._swap_alone_statement(group), params
                )
                swapped = store.swap_result(result.all())
        except errors.StorageError as exc:
            logger.info(
                "a swap failed, recording the outcomes as usual: %s",
                exc,
                extra={"action": "outbox_swap_retry"},
            )
            return None
        self._claim_took()
        taken = [from_row(r, group=group, claimed_at=started) for r in swapped.claimed]
        assert len(taken) <= len(swapped.done), "a swap claimed more rows than it recorded"
        self._recorder.tally(finished, swapped.done, report)
        room = self._room_after_swap(group, swapped, len(taken))
        blocked: dict[str, float] = {}
        if len(taken) < len(ids) or room > 0:
            # Slots not handed on, or room beside them: the usual refill (its own transaction, locked).
            if budget > len(taken) and free > len(taken):
                more, blocked = self._claim_during_batch(
                    token, budget - len(taken), free - len(taken), report, limited_only=True, busy=busy
                )
                taken.extend(more)
        elif taken:
            blocked[group] = SLOT_POLL_S  # full again: its next completion (or a poll) claims the next
        return sorted(taken, key=lambda r: r.id), blocked

    def _room_after_swap(self, group: str, swapped: store.SwapResult, taken: int) -> int:
        """Slots ``group`` has left beside the rows a swap handed on (the swap read its row, whose
        max_in_flight alone is then in force: trusted for the lock-free look); 1 when the row did not
        allow a swap (paused, a rate, a stale registration): the locked claim looks."""
        if swapped.max_in_flight is None:
            return 1
        self._applied[group] = (swapped.max_in_flight, None, time.monotonic() + APPLIED_TRUST_S)
        return swapped.max_in_flight - swapped.others - taken

    def _swap_alone_case(self, finished: list[Finished]) -> tuple[str, list[int], int | None] | None:
        """``(group, ids, status code)`` when ``finished`` can be recorded by one swap statement: rows of one
        group whose slots may be handed on, every one sent with the same status code; else None."""
        handed = self._handoffs(finished)
        if len(handed) != 1:
            return None
        ((group, ids),) = handed.items()
        outcomes = [d for _, d in finished]
        if len(ids) != len(finished) or any(
            d is None or d.outcome is not policy.Outcome.SENT for d in outcomes
        ):
            return None
        codes = {d.status_code for d in outcomes if d is not None}
        return (group, ids, codes.pop()) if len(codes) == 1 else None

    def _swap_alone_statement(self, group: str) -> sa.Executable:
        """The statement of :meth:`_swap_alone` (built once per group): :func:`store.swap` recording the
        finished rows SENT itself."""
        return self._swap_of(group, record_sent=True)

    def _swap_of(self, group: str, *, record_sent: bool) -> sa.Executable:
        key = (group, "swap_alone" if record_sent else "swap", None)
        stmt = self._statements_cache.get(key)
        if stmt is None:
            mine = self._group_limits[group][0]
            assert mine is not None
            stmt = self._statements_cache[key] = store.swap(
                group=group,
                topics=self._group_topics[group],
                max_in_flight=mine,
                claim_ms=self.claim_ms,
                fresh_ms=route_groups.FRESH_MS,
                record_sent=record_sent,
                async_commit=record_sent and self.async_swap_commit,
            )
        return stmt

    def _refill_claim(
        self,
        token: str,
        budget: int,
        free: int,
        busy: Collection[str],
        handed: Mapping[str, list[int]] | None = None,
    ) -> MergedRefill:
        """The refill claim to run inside the outcomes' transaction: first the swaps of ``handed`` rows'
        slots (before the outcomes are written: a swap reads their claims), then the claim of whatever
        capacity is left. What it reports (pauses seen, rows dead-lettered) goes to a report of its own,
        counted only once the transaction committed."""
        swapped: dict[str, tuple[list[Any], int | None]] = {}
        handed = dict(handed or {})

        def swap(conn: sa.Connection) -> None:
            self._claim_started = time.monotonic()
            swapped.clear()
            workers = min(budget, free)
            for group, ids in sorted(handed.items()):
                want = min(len(ids), workers)
                if want <= 0:
                    break
                result = store.swap_result(
                    conn.execute(
                        self._swap_statement(group), {"ids": ids, "token": token, "want": want}
                    ).all()
                )
                swapped[group] = (result.claimed, result.max_in_flight)
                workers -= len(result.claimed)

        def claim(
            conn: sa.Connection, matched: set[int]
        ) -> tuple[list[Claimed], dict[str, float], DispatchReport]:
            for group, (taken, _) in swapped.items():
                # Never more slots handed on than the group's finished rows whose outcomes were recorded
                # now (a claim lost between the swap and the outcome's write would otherwise leave its
                # slot counted twice): roll the whole transaction back, the outcomes are retried alone.
                if len(taken) > len(matched.intersection(handed[group])):
                    raise errors.StorageError(f"limit group {group}: a swap outran its recorded outcomes")
            sub = DispatchReport()
            started = self._claim_started
            rows, blocked = self._claim_in(
                conn, token, budget, free, sub, limited_only=True, started=started, busy=busy, swapped=swapped
            )
            return rows, blocked, sub

        return MergedRefill(swap, claim)

    def _swap_statement(self, group: str) -> sa.Executable:
        """The swap run in the transaction that records the finished rows' outcomes (built once per
        group): :func:`store.swap`, the outcomes written after it by the caller."""
        return self._swap_of(group, record_sent=False)

    @staticmethod
    def _absorb(report: DispatchReport, sub: DispatchReport) -> None:
        """Count what a committed refill claim reported into the batch's report."""
        report.paused.update(sub.paused)
        report.dead += sub.dead
        report.expired += sub.expired
        report.rows.extend(sub.rows)

    def _claim_took(self) -> None:
        """How long a claim takes here, to its commit (smoothed): rate admissions start that much ahead
        (x2), so a request is not already late when its claim commits."""
        self._claim_s = 0.8 * self._claim_s + 0.2 * (time.monotonic() - self._claim_started)

    def _claim(
        self,
        token: str,
        budget: int,
        free: int,
        report: DispatchReport,
        *,
        limited_only: bool,
        busy: Collection[str] = (),
    ) -> tuple[list[Claimed], dict[str, float]]:
        """One claim transaction (see :meth:`_claim_in`)."""
        started = time.monotonic()
        with translate_errors("claim outbox rows"), self.engine.begin() as conn:
            self._claim_started = started
            result = self._claim_in(
                conn, token, budget, free, report, limited_only=limited_only, started=started, busy=busy
            )
        self._claim_took()
        return result

    def _claim_during_batch(
        self, token: str, budget: int, free: int, report: DispatchReport, **options: Any
    ) -> tuple[list[Claimed], dict[str, float]]:
        """A claim while a batch runs (:meth:`_claim`, the same ``options``): a database error claims
        nothing, logged, instead of raising past the rows in flight and the outcomes still to record (the
        next turn looks again; the failed transaction rolled back, so nothing was claimed)."""
        try:
            return self._claim(token, budget, free, report, **options)
        except errors.StorageError as exc:
            logger.warning(
                "a claim during the batch failed; the rows in flight go on: %s",
                exc,
                extra={"action": "dispatch_claim_failed"},
            )
            return [], {}

    def _claim_in(
        self,
        conn: sa.Connection,
        token: str,
        budget: int,
        free: int,
        report: DispatchReport,
        *,
        limited_only: bool,
        started: float,
        busy: Collection[str] = (),
        swapped: Mapping[str, tuple[list[Any], int | None]] | None = None,
    ) -> tuple[list[Claimed], dict[str, float]]:
        """Read the groups' state, dead-letter rows past their window, claim rows of unlimited groups (up
        to ``budget``) and of limited groups (up to their capacity and ``free`` idle workers). Returns the
        rows and, per limited group whose due rows had to wait for capacity, the seconds worth waiting
        before looking again. ``swapped``: rows a swap already claimed in this transaction, per group
        (with the group's max_in_flight the swap read); they count against budget and workers."""
        # A refill claims only limited groups, whose locked row tells their pause: no read before.
        paused: set[str] = set()
        limited = set(self._limited_seen)
        if not limited_only:
            paused, limited = self._read_groups(conn, report, started)
        open_topics = [
            t
            for t in sorted(self.topics)
            if self._group_of[t] not in paused and (self._group_of[t] in limited or not limited_only)
        ]
        self._expire(conn, open_topics, report)
        rows: list[Claimed] = []
        if not limited_only:
            plain = [t for t in open_topics if self._group_of[t] not in limited]
            rows = self._claim_plain(conn, token, budget, plain, started)
        rows.extend(self._swapped_rows(swapped or {}, started))
        # A swap's statement ran in this transaction: it holds group rows FOR SHARE, and an exclusive lock
        # taken now could come after them out of the groups' order (a deadlock with another swap), so a
        # free slot is only reported (GROW_NOW: claimed in a transaction of its own).
        lock = not swapped
        blocked = self._claim_groups(
            conn, token, (budget, free), rows, sorted(limited), started, report, busy, lock
        )
        rows.sort(key=lambda r: r.id)
        return rows, blocked

    def _read_groups(
        self, conn: sa.Connection, report: DispatchReport, started: float
    ) -> tuple[set[str], set[str]]:
        """The routed groups' rows read: the paused ones (held off, noted in ``report``), and the ones to
        claim under their lock (limited here or by another dispatcher's registration)."""
        states = self._read_states(conn)
        paused = self._note_pauses(states, report, started)
        registered = {name for name, state in states.items() if state.limited}
        limited = capacity.limited_groups(self.groups, paused, self._group_limits, registered)
        self._limited_seen = frozenset(limited)
        return paused, limited

    def _swapped_rows(
        self, swapped: Mapping[str, tuple[list[Any], int | None]], started: float
    ) -> list[Claimed]:
        """The rows swaps claimed in this transaction, per group; a group a swap took rows of has its
        max_in_flight alone in force (the swap read its row), trusted for the lock-free look."""
        rows: list[Claimed] = []
        for name, (taken, applied) in sorted(swapped.items()):
            rows.extend(from_row(r, group=name, claimed_at=started) for r in taken)
            if taken:
                self._applied[name] = (applied, None, time.monotonic() + APPLIED_TRUST_S)
        return rows

    def _claim_groups(
        self,
        conn: sa.Connection,
        token: str,
        room: tuple[int, int],
        rows: list[Claimed],
        groups: list[str],
        started: float,
        report: DispatchReport,
        busy: Collection[str],
        lock: bool,
    ) -> dict[str, float]:
        """Claim the limited ``groups`` in their order, each under its lock (``lock``), into ``rows``, while
        ``room`` (the budget, the idle workers) has some beside the rows claimed already; returns the
        wait hints of the groups whose due rows had to wait for capacity."""
        budget, free = room
        blocked: dict[str, float] = {}
        workers = free - len(rows)
        for name in groups:
            left = min(budget - len(rows), workers)
            if left <= 0:
                break
            taken, wait_s = self._claim_limited(conn, token, name, left, started, report, name in busy, lock)
            rows.extend(taken)
            workers -= len(taken)
            if wait_s is not None:
                blocked[name] = wait_s
        return blocked

    def _claim_plain(
        self, conn: sa.Connection, token: str, budget: int, topics: list[str], started: float
    ) -> list[Claimed]:
        """Claim up to ``budget`` due rows of ``topics``, routes of unlimited groups (one statement)."""
        if not topics:
            return []
        stmt = store.claim_due(
            conn.dialect.name, token=token, limit=budget, claim_ms=self.claim_ms, topics=topics
        )
        return [from_row(r, claimed_at=started) for r in conn.execute(stmt)]

    def _note_pauses(
        self, states: Mapping[str, route_groups.GroupState], report: DispatchReport, started: float
    ) -> set[str]:
        """The groups ``states`` says are paused, noted in ``report`` and held off locally; a local pause
        the database no longer has (as read after this dispatcher's own pause write) ends: perhaps early,
        by an operator's ``joblease outbox resume``."""
        paused = {name for name, state in states.items() if state.paused}
        for name in self.groups - paused:
            if name in self._local_pause and self._pause_settled.get(name, -math.inf) < started:
                del self._local_pause[name]
        for name in paused:
            self._hold_off(name, states[name], report, started)
        return paused

    def _hold_off(
        self, group: str, state: route_groups.GroupState, report: DispatchReport, now: float
    ) -> None:
        """A group paused in the database: named in ``report``, and held off locally until its end."""
        assert state.paused_until is not None
        report.paused[group] = (state.paused_until.isoformat(), state.pause_reason or "")
        self._local_pause[group] = now + state.pause_remaining_ms / 1000

    def _read_states(self, conn: sa.Connection) -> dict[str, route_groups.GroupState]:
        """The routed limit groups' rows (pauses, limits): one indexed read of a small table per claim."""
        return route_groups.read_states(conn, self.groups)

    def _claim_limited(
        self,
        conn: sa.Connection,
        token: str,
        group: str,
        want: int,
        started: float,
        report: DispatchReport,
        busy: bool = False,
        lock: bool = True,
    ) -> tuple[list[Claimed], float | None]:
        """Claim up to ``want`` rows of a limited group under its row lock; the wait hint is set when due
        rows had to stay behind for capacity (``busy``: this batch has requests of the group in flight).
        ``lock=False``: this transaction already holds the group's row FOR SHARE (a swap); upgrading it
        could deadlock with another swap doing the same, so a free slot is only reported (hint 0.0: claim
        at once, in a transaction of its own)."""
        go_on, hint = self._unlocked_verdict(conn, group, lock)
        if not go_on:
            return [], hint
        state = route_groups.lock_group(conn, group)
        local_now = time.monotonic()
        if state.paused:
            self._hold_off(group, state, report, local_now)
            return [], None
        mif, rate, values = self._applied_limits(group, state, local_now)
        size, admission = self._size(conn, group, state, want, (mif, rate))
        rows: list[Claimed] = []
        if size is None or size > 0:
            rows = self._take(
                conn, token, group, want if size is None else size, size is None, mif, started, admission
            )
            if admission is not None and rows:
                next_ms = admission.rows.next_after(len(rows))
                values["rate_next_at"] = _as_stored(admission.now + dt.timedelta(milliseconds=next_ms), conn)
        route_groups.update_group(conn, group, values)
        return rows, self._hint(conn, group, (want, len(rows), size), admission, busy)

    def _hint(
        self,
        conn: sa.Connection,
        group: str,
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
        if capacity.held_back(want, got, size, rate_rows) and (busy or self._due_exists(conn, group)):
            return capacity.wait_hint(rate_rows)
        return None

    def _size(
        self,
        conn: sa.Connection,
        group: str,
        state: route_groups.GroupState,
        want: int,
        applied: tuple[int | None, int | None],
    ) -> tuple[int | None, _Admission | None]:
        """How many rows a locked claim of ``group`` takes (None: as many as its max_in_flight leaves,
        counted by the claim statement) and its rate's admissions, under the ``applied`` limits."""
        mif, rate = applied
        in_flight = store.count_in_flight(conn, group) if mif is not None and rate is not None else None
        size = capacity.claim_size(want, mif, rate, in_flight)
        if rate is None or size is None or size <= 0:
            return size, None
        admission = self._admit(conn, rate, state, size)
        return admission.rows.count, admission

    def _admit(self, conn: sa.Connection, rate: int, state: route_groups.GroupState, size: int) -> _Admission:
        """The rate's admissions for up to ``size`` rows of a locked group. The database clock is read
        once the group is locked, bracketed by local times: an admission's true local moment lies in
        [asked, answered] + its offset (see capacity.start_windows), so every dispatcher's requests start
        within RATE_LATE_S of their admissions whatever a loaded machine does to this round trip."""
        asked = time.monotonic()
        now = route_groups.database_now(conn)
        answered = time.monotonic()
        rows = limits.admit_rate(rate, state.rate_next_at, now, size, lead_ms=2000 * self._claim_s)
        return _Admission(rows, now, asked, answered)

    def _take(
        self,
        conn: sa.Connection,
        token: str,
        group: str,
        want: int,
        count_slots: bool,
        mif: int | None,
        started: float,
        admission: _Admission | None,
    ) -> list[Claimed]:
        """Claim up to ``want`` rows of a locked group (``count_slots``: and no more than its
        max_in_flight ``mif`` leaves, counted by the statement), each with its rate admission's window."""
        kind, cap = ("claim_slots", mif) if count_slots else ("claim", None)
        params = {"token": token, "want": want}
        claimed = sorted(conn.execute(self._group_statement(group, kind, cap), params), key=lambda r: r[0])
        windows: list[tuple[float | None, float | None]] = [(None, None)] * len(claimed)
        if admission is not None:
            windows = capacity.start_windows(
                admission.rows.offsets_ms, len(claimed), admission.asked, admission.answered
            )
        return [
            from_row(r, group=group, claimed_at=started, not_before=not_before, send_by=send_by)
            for r, (not_before, send_by) in zip(claimed, windows, strict=True)
        ]

    def _unlocked_verdict(self, conn: sa.Connection, group: str, lock: bool) -> tuple[bool, float | None]:
        """What can be told of ``group`` without its row lock: ``(True, None)``, take the lock and claim;
        else ``(False, the wait hint)`` (None: nothing to wait for)."""
        local_now = time.monotonic()
        if self._local_pause.get(group, 0.0) > local_now:
            # A downstream's pause this dispatcher knows of, perhaps not committed yet (a delivery thread
            # is writing it): nothing of the group is claimed, whatever its row says.
            return False, None
        trusted = capacity.trusted_max_in_flight(self._applied.get(group), local_now)
        if trusted is not None:
            # Only max_in_flight, its value known a moment ago: a plain read tells whether a slot is free,
            # so a dispatcher waiting for one does not queue for the group's row lock (which the holders'
            # refills and a pause being written need) only to learn that the group is full.
            in_flight, due = conn.execute(self._group_statement(group, "look", None)).one()
            if in_flight >= trusted:
                return False, (SLOT_POLL_S if due else None)
        return (True, None) if lock else (False, GROW_NOW)

    def _applied_limits(
        self, group: str, state: route_groups.GroupState, local_now: float
    ) -> tuple[int | None, int | None, dict[str, Any]]:
        """The max_in_flight and rate in force for ``group`` (its row ``state`` read under the lock), and
        the registrations this dispatcher writes to the row (its own value in force, not fresh)."""
        mine_mif, mine_rate = self._group_limits[group]
        mif = limits.applied_limit(mine_mif, state.max_in_flight, state.max_in_flight_live)
        rate = limits.applied_limit(mine_rate, state.rate, state.rate_live)
        self._applied[group] = (mif.value, rate.value, local_now + APPLIED_TRUST_S)
        values: dict[str, Any] = {}
        for name, applied, mine in (("max_in_flight", mif, mine_mif), ("rate", rate, mine_rate)):
            if applied.register and not state.registration_fresh(name, applied.value):
                values[name] = applied.value
                values[f"{name}_until"] = route_groups.registration_until()
            if applied.mismatch and (group, name, mine) not in self._mismatch_logged:
                self._mismatch_logged.add((group, name, mine))
                logger.warning(
                    "limit group %s: this dispatcher configures %s=%s, another dispatcher %s; the smallest "
                    "applies",
                    group,
                    name,
                    mine,
                    applied.value,
                    extra={"action": "limit_mismatch"},
                )
        return mif.value, rate.value, values

    def _group_statement(self, group: str, kind: str, max_in_flight: int | None) -> sa.Executable:
        """The statements a limited group's claims run, built once per group (building one costs more
        than running it): ``look``, a lock-free look at its slots and due rows; ``claim`` (up to
        ``want`` rows) and ``claim_slots`` (up to ``want`` and the slots left)."""
        key = (group, kind, max_in_flight)
        stmt = self._statements_cache.get(key)
        if stmt is not None:
            return stmt
        dialect = self.engine.dialect.name
        topics = self._group_topics[group]
        if kind == "look":
            stmt = store.slot_look(group, topics)
        else:
            slots = None
            if kind == "claim_slots":
                assert max_in_flight is not None
                slots = functools.partial(store.slots_left, dialect, group, max_in_flight)
            stmt = store.claim_for_group(
                dialect, group=group, topics=topics, claim_ms=self.claim_ms, slots=slots
            )
        self._statements_cache[key] = stmt
        return stmt

    def _due_exists(self, conn: sa.Connection, group: str) -> bool:
        return conn.execute(store.due_in(self._group_topics[group])).first() is not None

    def _expire(self, conn: sa.Connection, topics: list[str], report: DispatchReport) -> None:
        """Dead-letter due rows of ``topics`` whose route's dedupe_window has passed (one UPDATE per
        window setting; nothing at all when no route sets one)."""
        if not self._windows:
            return
        allowed = set(topics)
        for (window_ms, margin_ms), window_topics in self._windows.items():
            scoped = [t for t in window_topics if t in allowed]
            if not scoped:
                continue
            reason = decisions.dedupe_window_reason(window_ms / 1000)
            stmt = store.expire_past_window(
                topics=scoped, window_ms=window_ms, margin_ms=margin_ms, reason=reason
            )
            for r in conn.execute(stmt):
                report.dead += 1
                report.expired += 1
                reason = f"dedupe_window ({window_ms / 1000:g} s) passed since the first attempt"
                if len(report.rows) < MAX_REPORT_ROWS:
                    report.rows.append(
                        RowOutcome(r.id, r.idempotency_key, r.topic, "dead", r.last_status, reason)
                    )
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
