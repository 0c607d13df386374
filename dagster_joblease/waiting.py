"""One wait-and-take-over engine: claim a set of keys, wait for live holders, take over dead ones, and end
every key with a true outcome, on every exit path.

A scheduler's run (a Dagster run of one partition, or a range of them) wants a set of logical runs. For each
key the engine claims the lease and runs the caller's body under it; a key another holder has is claimed
again, with back-off, until a deadline (``held_wait_ms``); a holder that is *dead* (its heartbeat missing
for four of its own recorded intervals, or stale while the caller proves its run finished: the liveness
rule, :func:`dagster_joblease.staleness.holder_death`) has its lease failed at once and the key is claimed
again. It reports one :class:`KeyOutcome` per key, in the order given:

==================  ======================================================================================
``won``             this run claimed the key first and did it
``reclaimed``       this run took over after a failed, expired or dead holder, and did it
``skipped-succeeded``  another holder already did it (``holder``: the winner)
``held``            a live holder still had it when the wait ended (``holder``: that holder)
``failed``          this run held it and its body raised, or the run was interrupted while it held it
                    (its lease released for a retry)
``lost``            this run's lease was taken from it before it could finish
``not-attempted``   this run never held the key: the range stopped first, or was interrupted (or the
                    database failed) while claiming or waiting for it
==================  ======================================================================================

Two modes share the waiting: :func:`settle_each` calls the body once per key (a single partition is a set
of one), :func:`settle_batch` claims the keys with one statement and calls the body once per set won.
An interrupt (``KeyboardInterrupt``, Dagster's run termination, any ``BaseException``) or an error outside
the body (a database outage) stops the engine: it releases what it holds, records every key, and returns
the interrupt or error in :class:`Report` for the caller to re-raise once it has recorded the outcomes.

The engine's decisions are pure functions (:func:`after_refusal`, :func:`stale_running`,
:func:`cut_short`, :func:`range_goes_on`, :func:`next_delay`), tested table by table. Nothing here imports
a scheduler: what only the scheduler knows (is a holder's process gone? what to record on its run? where
to log?) comes through :class:`Watcher`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import sqlalchemy as sa

from dagster_joblease import batch, errors, identity, options, staleness
from dagster_joblease.lease import Lease, LeaseService, LeaseStatus, NotAcquiredReason, error_text
from dagster_joblease.storage import leases as leases_store
from dagster_joblease.storage.engine import translate_errors

__all__ = [
    "DONE",
    "FIRST_POLL_S",
    "MAX_POLL_S",
    "KeyOutcome",
    "Next",
    "WaitOutcome",
    "Report",
    "Row",
    "Wait",
    "Watcher",
    "after_refusal",
    "cut_short",
    "death_of",
    "next_delay",
    "range_goes_on",
    "read_row",
    "settle_batch",
    "settle_each",
    "stale_running",
]

#: The first poll for a held key comes after this long; each next one after twice as long, up to MAX_POLL_S.
FIRST_POLL_S = 0.05
MAX_POLL_S = 1.0


class WaitOutcome(enum.StrEnum):
    """What one key came to (see the module's table)."""

    WON = "won"
    RECLAIMED = "reclaimed"
    SKIPPED_SUCCEEDED = "skipped-succeeded"
    HELD = "held"
    FAILED = "failed"
    LOST = "lost"
    NOT_ATTEMPTED = "not-attempted"


#: The key's effect is recorded, by this run or (a skip) provably by another.
DONE = frozenset({WaitOutcome.WON, WaitOutcome.RECLAIMED, WaitOutcome.SKIPPED_SUCCEEDED})


@dataclasses.dataclass(frozen=True)
class Row:
    """A lease row as a waiter sees it; ages and time left are measured on the database clock."""

    status: str
    attempt: int
    owner_token: str = dataclasses.field(repr=False)  # a fencing capability: never in a repr
    holder: str | None
    heartbeat_age_ms: int
    remaining_ms: int
    heartbeat_ms: int | None  #: the holder's recorded interval (None: a row from before migration 0002)


def read_row(engine: sa.Engine, key: str) -> Row | None:
    """The row of idempotency key ``key`` as a waiter sees it (None: no row)."""
    with translate_errors("read a lease"), engine.connect() as connection:
        row = leases_store.waiter_view(connection, key)
    return None if row is None else Row(*row)


@dataclasses.dataclass(frozen=True)
class KeyOutcome:
    """One key's outcome. ``holder``: the holder this outcome is about (this run's label when it held
    the key, the winner's on a skip, the live holder's on ``held``); ``lease``: the lease this run held
    for it (None: never held); ``result``: the body's return value (won or reclaimed)."""

    job: identity.JobIdentity
    outcome: WaitOutcome
    attempt: int | None = None
    holder: str | None = None
    error: str | None = None
    result: Any = None
    lease: Lease | None = None

    @property
    def done(self) -> bool:
        return self.outcome in DONE


@dataclasses.dataclass
class Report:
    """Every key's outcome in the order given, and what stopped the engine early (if anything): the first
    error (the body's, or the database's) and an interrupt, for the caller to re-raise."""

    outcomes: list[KeyOutcome]
    error: BaseException | None = None
    interrupt: BaseException | None = None


class Log(Protocol):
    def info(self, msg: str) -> None: ...

    def warning(self, msg: str) -> None: ...

    def error(self, msg: str) -> None: ...


class Watcher(Protocol):
    """What only the scheduler knows."""

    log: Log

    def dead_because(self, holder: str | None) -> str | None:
        """Why ``holder``'s process is gone (e.g. "its Dagster run is FAILURE"); None: it may be alive."""
        ...

    def took_over(self, job: identity.JobIdentity, row: Row, reason: str) -> None:
        """This engine failed ``row``'s lease, its holder dead: record it where that holder reports."""
        ...


@dataclasses.dataclass(frozen=True)
class Wait:
    """How the engine claims and waits: the service (and holder label), the lease timing, the bounded wait
    for live holders, who takes over (for the reason recorded on a dead holder's row), the watcher, and
    (per-key mode) after how many keys failing one after the other a range stops."""

    service: LeaseService
    timing: options.LeaseTiming
    held_wait_ms: int
    taker: str
    watcher: Watcher
    max_failures_in_a_row: int = 3

    @property
    def holder(self) -> str | None:
        return self.service.holder


# -- decisions -------------------------------------------------------------------------------------------


class Next(enum.Enum):
    """What a waiter does with a key (or the keys) after a refused claim (see :func:`after_refusal`)."""

    SKIP = "skip"  #: another holder completed it: a recorded skip
    RETRY = "retry"  #: its dead holder was just failed: claim again at once
    WAIT = "wait"  #: a live holder (or a lost race) and time left: wait, then claim again
    HELD = "held"  #: the wait is over and it is still not ours: ``held``


def after_refusal(status: str | None, *, took_over: bool, past_deadline: bool) -> Next:
    """The decision after a refused claim, from the row's status as read (None: no row, or in batch mode
    not a completed one), whether a dead holder was just failed (``took_over``), and whether the bounded
    wait has ended (per key: now; batch: when the round of claims began)."""
    if status == LeaseStatus.SUCCESS.value:
        return Next.SKIP
    if took_over:
        return Next.RETRY
    return Next.HELD if past_deadline else Next.WAIT


def stale_running(status: str | None, heartbeat_age_ms: int, stale_ms: int | None) -> bool:
    """Is this a ``RUNNING`` row whose heartbeat is older than its holder's staleness threshold? (Then,
    and only then, is it worth asking whether the holder's process is gone.)"""
    return status == LeaseStatus.RUNNING.value and staleness.is_stale(heartbeat_age_ms, stale_ms)


def death_of(row: Row, run_finished: str | None, legacy_ms: int) -> staleness.Death | None:
    """Why the holder of ``row`` is dead to a waiter (the liveness rule, :func:`staleness.holder_death`;
    ``run_finished``: what the watcher said of its run), or None: alive, wait for it."""
    return staleness.holder_death(
        status=row.status,
        overdue_ms=-row.remaining_ms,
        heartbeat_age_ms=row.heartbeat_age_ms,
        heartbeat_ms=row.heartbeat_ms,
        run_finished=run_finished,
        legacy_ms=legacy_ms,
    )


def cut_short(*, held: bool, completed: bool) -> WaitOutcome | None:
    """The outcome of the key an interrupt or an error outside the body stopped on: ``not-attempted`` if this
    run never held it (claiming, or waiting for another holder); None (done: the caller records it as
    won) if its lease was completed first; else ``failed`` (its lease released or left to expire)."""
    if not held:
        return WaitOutcome.NOT_ATTEMPTED
    return None if completed else WaitOutcome.FAILED


def range_goes_on(failures_in_a_row: int, max_failures_in_a_row: int) -> bool:
    """Per-key mode: does the range try its next key after this many keys failed one after the other?"""
    return failures_in_a_row < max_failures_in_a_row


def next_delay(delay_s: float) -> float:
    """The next poll's delay after one of ``delay_s``: twice as long, at most :data:`MAX_POLL_S`."""
    return min(delay_s * 2, MAX_POLL_S)


# -- waiting and taking over -----------------------------------------------------------------------------


class _Backoff:
    """The waiter's pacing: polls from FIRST_POLL_S doubling to MAX_POLL_S, never past the deadline; one
    log line when the waiting starts."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.delay = FIRST_POLL_S
        self.announced = False

    def sleep(self, deadline: float, message: str | None) -> None:
        if message is not None and not self.announced:
            self.announced = True
            self.log.info(message)
        time.sleep(max(0.0, min(self.delay, deadline - time.monotonic())))
        self.delay = next_delay(self.delay)


def _take_over_if_dead(wait: Wait, job: identity.JobIdentity, row: Row | None) -> bool:
    """A ``RUNNING`` row whose holder is dead by the liveness rule (:func:`staleness.holder_death`: its
    heartbeat missing for the failover tolerance, or stale while the watcher knows its run finished): fail
    it now so it can be reclaimed. True if the caller should claim again. (An expired row needs no
    takeover: the next claim reclaims it.)"""
    if row is None:
        return False
    legacy_ms = 2 * wait.timing.heartbeat_ms
    stale_ms = staleness.stale_after_ms(row.heartbeat_ms, legacy_ms=legacy_ms)
    finished = (
        wait.watcher.dead_because(row.holder)
        if stale_running(row.status, row.heartbeat_age_ms, stale_ms)
        else None
    )
    death = death_of(row, finished, legacy_ms)
    if death is None or death.fence_ms is None:
        return False
    reason = f"attempt {row.attempt}: holder {row.holder} is dead ({death.why}); taken over by {wait.taker}"
    if wait.service.fail_dead_holder(
        job, attempt=row.attempt, owner_token=row.owner_token, stale_ms=death.fence_ms, reason=reason
    ):
        wait.watcher.log.warning(f"joblease {job}: {reason}")
        wait.watcher.took_over(job, row, reason)
    return True  # reclaim it now (or see who did)


def _held_error(wait: Wait, job: identity.JobIdentity, row: Row | None) -> str:
    if row is None or row.status != LeaseStatus.RUNNING.value:
        return (
            f"partition {job.run_key or '(initial)'} of code {job.code!r} could not be claimed "
            f"within {wait.held_wait_ms} ms; retry later"
        )
    return (
        f"partition {job.run_key or '(initial)'} of code {job.code!r} is still held by "
        f"{row.holder} (attempt {row.attempt}, {max(row.remaining_ms, 0)} ms left on its lease) "
        f"after waiting {wait.held_wait_ms} ms; retry later"
    )


def _held_outcome(wait: Wait, job: identity.JobIdentity, row: Row | None) -> KeyOutcome:
    running = row is not None and row.status == LeaseStatus.RUNNING.value
    return KeyOutcome(
        job,
        WaitOutcome.HELD,
        attempt=row.attempt if row else None,
        holder=row.holder if running and row is not None else None,
        error=_held_error(wait, job, row),
    )


def _held_now(wait: Wait, job: identity.JobIdentity) -> KeyOutcome:
    row = None
    with contextlib.suppress(errors.StorageError):
        row = read_row(wait.service.engine, job.idempotency_key)
    return _held_outcome(wait, job, row)


def _did(wait: Wait, held: Lease, result: Any = None) -> KeyOutcome:
    outcome = WaitOutcome.RECLAIMED if held.reclaimed else WaitOutcome.WON
    return KeyOutcome(held.identity, outcome, held.attempt, wait.holder, result=result, lease=held)


def _stopped_text(exc: BaseException, *, held: bool) -> str:
    if isinstance(exc, Exception):
        return error_text(exc)
    name = type(exc).__name__
    return (
        f"interrupted by {name}; the lease was released"
        if held
        else (f"interrupted by {name} before this run held the key")
    )


def _was_completed(wait: Wait, held: Lease) -> bool:
    """Was ``held`` completed (SUCCESS with this run's token)? False when the row cannot be read."""
    try:
        row = read_row(wait.service.engine, held.idempotency_key)
    except errors.StorageError:
        return False
    return row is not None and row.status == LeaseStatus.SUCCESS.value and row.owner_token == held.owner_token


# -- per-key mode ----------------------------------------------------------------------------------------


class _Stopped(Exception):
    """A key was stopped by ``cause`` (the body's error, the database's, or an interrupt); ``outcome`` is
    that key's recorded outcome."""

    def __init__(self, outcome: KeyOutcome, cause: BaseException) -> None:
        super().__init__(outcome.error)
        self.outcome = outcome
        self.cause = cause


class _EachKey:
    """One key of :func:`settle_each`: claimed and run under ``run_exclusive``, waited for when held."""

    def __init__(self, wait: Wait, job: identity.JobIdentity, body: Callable[[Lease], Any]) -> None:
        self.wait = wait
        self.job = job
        self.body = body
        self.lease: Lease | None = None
        self.waiting_for: str | None = None  #: the log line when the waiting for a live holder starts

    def _run(self, held: Lease) -> Any:
        self.lease = held
        return self.body(held)

    def _claim(self) -> KeyOutcome | None:
        wait = self.wait
        outcome = wait.service.run_exclusive(
            self.job, self._run, lease_ms=wait.timing.lease_ms, heartbeat_ms=wait.timing.heartbeat_ms
        )
        return None if outcome.lease is None else _did(wait, outcome.lease, outcome.result)

    def _refused(self, deadline: float) -> KeyOutcome | Next:
        wait, job = self.wait, self.job
        row = read_row(wait.service.engine, job.idempotency_key)
        took_over = _take_over_if_dead(wait, job, row)
        status = None if row is None else row.status
        decided = after_refusal(status, took_over=took_over, past_deadline=time.monotonic() >= deadline)
        if decided is Next.SKIP and row is not None:
            return KeyOutcome(job, WaitOutcome.SKIPPED_SUCCEEDED, row.attempt, row.holder)
        if decided is Next.HELD:
            return _held_outcome(wait, job, row)
        if decided is Next.WAIT and row is not None and row.status == LeaseStatus.RUNNING.value:
            self.waiting_for = (
                f"joblease {job}: held by {row.holder} (attempt {row.attempt}); waiting up to "
                f"{wait.held_wait_ms} ms for it to finish"
            )
        return decided

    def settle(self, deadline: float) -> KeyOutcome:
        """The key's outcome; raises :class:`_Stopped` (with the outcome) when it ends with an exception."""
        backoff = _Backoff(self.wait.watcher.log)
        try:
            while True:
                done = self._claim()
                if done is not None:
                    return done
                decided = self._refused(deadline)
                if isinstance(decided, KeyOutcome):
                    return decided
                if decided is Next.WAIT:
                    backoff.sleep(deadline, self.waiting_for)
        except BaseException as exc:
            raise _Stopped(self.stopped(exc), exc) from exc

    def stopped(self, exc: BaseException) -> KeyOutcome:
        held = self.lease
        if held is not None and isinstance(exc, errors.LostLeaseError):
            return KeyOutcome(self.job, WaitOutcome.LOST, held.attempt, self.wait.holder, error_text(exc))
        outcome = cut_short(
            held=held is not None, completed=held is not None and _was_completed(self.wait, held)
        )
        if outcome is None and held is not None:
            return _did(self.wait, held)
        if held is None:
            return KeyOutcome(self.job, WaitOutcome.NOT_ATTEMPTED, error=_stopped_text(exc, held=False))
        return KeyOutcome(
            self.job,
            WaitOutcome.FAILED,
            held.attempt,
            self.wait.holder,
            _stopped_text(exc, held=True),
            lease=held,
        )


def settle_each(wait: Wait, jobs: Sequence[identity.JobIdentity], body: Callable[[Lease], Any]) -> Report:
    """Per-key mode: ``body(lease)`` once per key won, under :meth:`LeaseService.run_exclusive`.

    Every key is tried once before any waiting; the keys a live holder has are then waited for together,
    within one ``held_wait_ms``. A key whose body raises fails its own lease and the range goes on, unless
    ``max_failures_in_a_row`` keys fail one after the other (an error outside the body, e.g. the database
    gone, counts too); the rest are ``not-attempted``. An interrupt stops at once: the key in progress is
    released (``failed``), or ``not-attempted`` when this run never held it; the rest ``not-attempted``.
    """
    outcomes: dict[int, KeyOutcome] = {}
    report = Report([])
    started = time.monotonic()
    in_a_row = 0

    def attempt(i: int, deadline: float) -> bool:
        nonlocal in_a_row
        try:
            outcomes[i] = _EachKey(wait, jobs[i], body).settle(deadline)
        except _Stopped as stopped:
            outcomes[i] = stopped.outcome
            if not isinstance(stopped.cause, Exception):
                report.interrupt = stopped.cause
                return False
            report.error = report.error or stopped.cause
            in_a_row += 1
        else:
            in_a_row = 0 if outcomes[i].done else in_a_row
        if range_goes_on(in_a_row, wait.max_failures_in_a_row):
            return True
        wait.watcher.log.error(
            f"joblease: {in_a_row} keys failed one after the other (max_failures_in_a_row="
            f"{wait.max_failures_in_a_row}); the range stops here and the keys after "
            f"{jobs[i].run_key} are not attempted"
        )
        return False

    went_on = all(attempt(i, started) for i in range(len(jobs)))  # first pass: no waiting
    if went_on and wait.held_wait_ms > 0:
        deadline = started + wait.held_wait_ms / 1000
        held = [i for i, o in sorted(outcomes.items()) if o.outcome is WaitOutcome.HELD]
        all(attempt(i, deadline) for i in held)
    report.outcomes = [
        outcomes.get(i) or KeyOutcome(job, WaitOutcome.NOT_ATTEMPTED) for i, job in enumerate(jobs)
    ]
    return report


# -- batch mode ------------------------------------------------------------------------------------------


class _WaitBatch:
    """The state of one :func:`settle_batch`: every key's outcome so far, the first error, an interrupt."""

    def __init__(self, wait: Wait, body: Callable[[Sequence[Lease]], Any]) -> None:
        self.wait = wait
        self.body = body
        self.outcomes: dict[str, KeyOutcome] = {}
        self.report = Report([])

    def record(self, held: Lease, outcome: WaitOutcome, error: str | None = None, result: Any = None) -> None:
        self.outcomes[held.idempotency_key] = KeyOutcome(
            held.identity, outcome, held.attempt, self.wait.holder, error, result, held
        )

    def refused_set(self, won: Sequence[Lease], exc: errors.LostLeaseError) -> None:
        """The set's fenced transaction was refused: ``lost`` for the keys taken over, ``failed`` for the
        rest (failed by this run with the set). Nothing of the set was written."""
        lost_keys = exc.lost_keys if isinstance(exc, errors.LostBatchLeaseError) else None
        for x in won:
            if lost_keys is None or x.idempotency_key in lost_keys:
                self.record(x, WaitOutcome.LOST, error_text(exc))
            else:
                why = f"failed by this run with its set: another key of the set was lost ({error_text(exc)})"
                self.record(x, WaitOutcome.FAILED, why)

    def failed_set(self, won: Sequence[Lease], exc: Exception) -> None:
        """The body raised: fail the whole set for a retry (``lost`` for a key no longer ours)."""
        try:
            lost = {x.idempotency_key for x in batch.fail_many(self.wait.service, won, exc).lost}
        except errors.JobLeaseError as failure:  # the leases then expire; the body's error is the news
            self.wait.watcher.log.warning(
                f"joblease: could not record the failure of {len(won)} leases: {failure}"
            )
            lost = set()
        for x in won:
            self.record(
                x, WaitOutcome.LOST if x.idempotency_key in lost else WaitOutcome.FAILED, error_text(exc)
            )

    def call(self, won: Sequence[Lease]) -> bool:
        """Call the body with the set ``won``; record every key of it. False when the range must stop."""
        service = self.wait.service
        try:
            with batch.BatchHeartbeat(service, won, heartbeat_ms=self.wait.timing.heartbeat_ms):
                value = self.body(won)
        except errors.LostLeaseError as exc:
            self.refused_set(won, exc)
            self.report.error = self.report.error or exc
            return False
        except Exception as exc:
            self.failed_set(won, exc)
            self.report.error = self.report.error or exc
            return False
        except BaseException as exc:  # an interrupt: give the set back for a retry at once
            with contextlib.suppress(errors.JobLeaseError):
                batch.release_many(service, won, f"released: interrupted by {type(exc).__name__}")
            for x in won:
                self.record(x, WaitOutcome.FAILED, _stopped_text(exc, held=True))
            raise
        lost = self.complete(won)
        for x in won:
            if x.idempotency_key in lost:
                self.record(
                    x, WaitOutcome.LOST, "LostLeaseError: the lease was taken over before the set completed"
                )
            else:
                self.record(x, WaitOutcome.RECLAIMED if x.reclaimed else WaitOutcome.WON, result=value)
        return True

    def complete(self, won: Sequence[Lease]) -> set[str]:
        """Complete the set; the keys lost. Cut short (an error or an interrupt), each key is recorded as
        what it came to (done if its completion committed, else ``failed``) before the stop goes on."""
        try:
            return {x.idempotency_key for x in batch.complete_many(self.wait.service, won).lost}
        except BaseException as exc:
            for x in won:
                if cut_short(held=True, completed=_was_completed(self.wait, x)) is None:
                    self.record(x, WaitOutcome.RECLAIMED if x.reclaimed else WaitOutcome.WON)
                else:
                    self.record(x, WaitOutcome.FAILED, _stopped_text(exc, held=True))
            raise

    def claim_round(self, pending: Sequence[identity.JobIdentity]) -> tuple[list[identity.JobIdentity], bool]:
        """Claim every pending key (in chunks) and call the body with each chunk's keys won; keys already
        succeeded are recorded skips. The keys still held by another, and False when the range must stop."""
        wait = self.wait
        waiting: list[identity.JobIdentity] = []
        for start in range(0, len(pending), batch.MAX_BATCH_KEYS):
            claim = batch.claim_many(
                wait.service,
                pending[start : start + batch.MAX_BATCH_KEYS],
                lease_ms=wait.timing.lease_ms,
                heartbeat_ms=wait.timing.heartbeat_ms,
            )
            for refused in claim.refused:
                if refused.reason is NotAcquiredReason.SUCCEEDED:
                    self.outcomes[refused.idempotency_key] = KeyOutcome(
                        refused.identity, WaitOutcome.SKIPPED_SUCCEEDED, refused.attempt, refused.holder
                    )
                else:
                    waiting.append(refused.identity)
            if claim.leases and not self.call(claim.leases):
                return waiting, False
        return waiting, True

    def rounds(self, jobs: Sequence[identity.JobIdentity]) -> None:
        """Claim rounds until every key is settled, the range must stop, or a round that began after the
        bounded wait ended still finds keys held (so a key freed while a long call ran is looked at once
        more); those keys are ``held``."""
        wait = self.wait
        deadline = time.monotonic() + wait.held_wait_ms / 1000
        backoff = _Backoff(wait.watcher.log)
        pending = list(jobs)
        while True:
            began = time.monotonic()
            pending, go_on = self.claim_round(pending)
            if not go_on or not pending:
                return
            took_over = False
            for job in pending:  # every waited-for key's dead holder is failed, not just the first's
                row = read_row(wait.service.engine, job.idempotency_key)
                took_over = _take_over_if_dead(wait, job, row) or took_over
            decided = after_refusal(None, took_over=took_over, past_deadline=began >= deadline)
            if decided is Next.HELD:
                for job in pending:
                    self.outcomes[job.idempotency_key] = _held_now(wait, job)
                return
            if decided is Next.WAIT:
                backoff.sleep(
                    deadline,
                    f"joblease: {len(pending)} keys are held by another holder; waiting up to "
                    f"{wait.held_wait_ms} ms for them (the keys won then go to a further call)",
                )


def settle_batch(
    wait: Wait, jobs: Sequence[identity.JobIdentity], body: Callable[[Sequence[Lease]], Any]
) -> Report:
    """Batch mode: claim every key in one statement, call ``body(leases)`` once with the keys won (under
    one :class:`~dagster_joblease.batch.BatchHeartbeat`), complete them with one statement. Keys already
    succeeded are skips; keys a live holder has are claimed again until the bounded wait ends, and the keys
    won then go to a further call. A call that raises fails its whole set and ends the range (the rest
    ``not-attempted``). An interrupt or an error while claiming or waiting keeps what was done; the keys
    this run never held are ``not-attempted``, with the error or interrupt named."""
    state = _WaitBatch(wait, body)
    stopped: BaseException | None = None
    try:
        state.rounds(jobs)
    except Exception as exc:  # e.g. the database went away while claiming or waiting
        stopped = exc
        state.report.error = state.report.error or exc
    except BaseException as exc:  # an interrupt while claiming, calling or waiting
        stopped = state.report.interrupt = exc
    state.report.outcomes = [
        state.outcomes.get(job.idempotency_key)
        or KeyOutcome(
            job,
            WaitOutcome.NOT_ATTEMPTED,
            error=None if stopped is None else _stopped_text(stopped, held=False),
        )
        for job in jobs
    ]
    return state.report
